// esplag train: a new run from a config, or the continuation of a saved one.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>

#include "args.h"
#include "commands.h"
#include "core/error.h"
#include "local_ranks.h"
#include "train/stop_signal.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace esplag::cli {

namespace {

int train(const Args& a) {
  if (a.int32("gpus") > 1) return run_as_local_ranks(kTrain, a.int32("gpus"));
  std::unique_ptr<Trainer> trainer;
  if (a.has("resume")) {
    ESPLAG_CHECK(!a.has("config") && a.all("set").empty() && !a.has("out"),
                 "train --resume continues a run with its saved config in its own directory; --config, --set and "
                 "--out do not apply");
    ResumeOptions options;
    options.steps = a.integer("steps", 0);
    options.device = a.get("device", "");
    options.schedule = schedule_on_resume_from(a.get("schedule"));
    options.allow_inexact = a.has("allow-inexact");
    trainer = Trainer::resume(a.get("resume"), print_line, options);
  } else {
    ESPLAG_CHECK(!a.has("schedule") && !a.has("allow-inexact"),
                 "train: --schedule and --allow-inexact apply to --resume only");
    ESPLAG_CHECK(a.has("config"), "train: --config is required (or --resume RUN_DIR; see esplag train --help)");
    const std::string config_path = a.get("config");
    TrainConfig cfg = load_train_config(config_path, a.all("set"));
    if (a.has("steps")) cfg.steps = cfg.schedule.total_steps = a.integer("steps", 0);
    if (a.has("device")) cfg.device = a.get("device", "");
    const std::string out = a.get("out", "runs/" + fs::path(config_path).stem().string());
    trainer = std::make_unique<Trainer>(cfg, out, print_line);
  }
  // After the run's setup, so that a signal before it ends the process as usual.
  install_stop_handlers();
  const TrainResult r = trainer->run();
  if (r.steps_run == 0) return 0;  // nothing to do: the trainer's log said why
  const int sig = stop_signal();
  if (!trainer->leader()) return r.interrupted ? 128 + sig : 0;  // rank 0 speaks for the run
  if (r.interrupted) {
    std::fprintf(stderr, "esplag: interrupted by %s at step %lld; checkpoint %s; continue with: esplag train --resume %s\n",
                 sig == SIGTERM ? "SIGTERM" : "SIGINT", static_cast<long long>(r.steps), r.last_checkpoint.c_str(),
                 trainer->run_dir().c_str());
    return 128 + sig;
  }
  std::printf("done: %lld steps, loss %.4f -> %.4f, val loss %.4f, checkpoint %s\n",
              static_cast<long long>(r.steps), r.first_loss, r.last_loss, r.final_val_loss,
              r.last_checkpoint.c_str());
  return 0;
}

}  // namespace

const Command kTrain = {
    "train",
    "train a model from a config, or resume a run",
    "  esplag train --config FILE.yaml [--set key=value]... [--out RUN_DIR]\n"
    "  esplag train --resume RUN_OR_CHECKPOINT_DIR [--steps N]\n"
    "The config keys are described in docs/config.md; a resumed run continues from its latest checkpoint\n"
    "(or the step-NNNNNN directory given) with the config saved in it. The first SIGINT/SIGTERM finishes the\n"
    "step under way, saves a checkpoint and exits with 128 + the signal; a second one exits at once.\n"
    "--gpus N runs the command as N local processes, one per GPU, as `torchrun --nproc-per-node N` would;\n"
    "under torchrun, mpirun or srun, leave it out: the launcher starts the ranks (docs/distributed.md).",
    {
        Option::text("config", "FILE.yaml", "", "the run's config (a new run)"),
        Option::list("set", "KEY=VALUE", "override one config key, e.g. train.steps=100"),
        Option::text("out", "RUN_DIR", "", "the run directory (default: runs/<config name>)"),
        Option::text("resume", "DIR", "", "continue the run in DIR (or from its checkpoint step-NNNNNN)"),
        Option::integer("steps", "", 1, kInt64Max, "total optimizer steps (default: train.steps of the config)"),
        Option::text("device", "cpu|cuda|auto", "", "where the steps run (default: train.device of the config)"),
        Option::text("schedule", "keep|stretch", "keep",
                     "with --resume and a new --steps: keep the saved LR schedule (steps past its end run at its "
                     "final LR) or stretch it over the new total"),
        Option::integer("gpus", "1", 1, 1024,
                        "local processes, one per GPU: N > 1 runs this command as N ranks and stops them all when "
                        "one fails"),
        Option::flag("allow-inexact", "with --resume: resume a checkpoint without state.json (the data and the "
                                      "RNG restart from the beginning)"),
    },
    train,
};

}  // namespace esplag::cli
