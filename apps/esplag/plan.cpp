// esplag plan: the memory a training run of a config needs, on the host and on the GPU, by
// category, for one rank of --gpus N under train.parallel.zero; whether it fits; the
// cheapest settings that would; and with train.memory auto what the run would choose.
// Nothing is allocated.
#include <algorithm>
#include <cmath>

#include "commands.h"
#include "core/error.h"
#include "data/prepare.h"
#include "dist/world.h"
#include "train/checkpoint.h"
#include "train/memory_plan.h"
#include "train/trainer.h"

namespace esplag::cli {

namespace {

// A number option read in GiB.
Option gib(Option o) {
  o.value = "GiB";
  return o;
}

uint64_t gib_to_bytes(double gib) { return uint64_t(std::llround(gib * double(uint64_t(1) << 30))); }

// The model the run trains, as the trainer resolves it: train.init_from's, and a
// model.vocab_size of 0 taken from the dataset.
void resolve_model(TrainConfig& cfg) {
  if (cfg.init_from.empty() && cfg.model.vocab_size != 0) return;
  DatasetMeta meta;
  try {
    meta = read_dataset_meta(cfg.data_path);
  } catch (const Error& e) {
    fail(cfg.init_from.empty() ? "model.vocab_size 0 is the dataset's vocabulary (or give --set model.vocab_size=N), "
                               : "train.init_from needs the dataset's tokenizer, ",
         "but ", e.what());
  }
  if (!cfg.init_from.empty()) cfg.model = init_from_model(cfg, meta.tokenizer);
  if (cfg.model.vocab_size == 0) cfg.model.vocab_size = meta.vocab_size;
}

// train.device as the trainer resolves it (choose_train_device), with its refusals of what
// the GPU does not train (gpu_training_blocker): auto stays on the CPU with the trainer's note
// (printed), cuda is the trainer's error. A cuda run is planned without a GPU here too.
std::string planned_device(const TrainConfig& cfg) {
  DeviceProbe probe = probe_devices();
  if (cfg.device == "cuda") probe = {true, std::max(probe.gpus, 1), ""};
  const DeviceChoice choice = choose_train_device(cfg.device, probe, gpu_training_blocker(cfg));
  if (!choice.note.empty()) std::cout << choice.note << std::endl;
  return choice.device;
}

// The data-parallel ranks to plan one of: --gpus, else the launcher's (WORLD_SIZE, ...), else 1.
int world_size(const Args& a) { return a.has("gpus") ? a.int32("gpus") : world_from_env().size; }
// Those on this host, which share its memory: all of --gpus (train --gpus N starts them here),
// else the launcher's (LOCAL_WORLD_SIZE, ...).
int local_ranks(const Args& a) { return a.has("gpus") ? a.int32("gpus") : world_from_env().local_size; }

// The memory at hand as the trainer sees it, where --gpu-memory or --host-memory do not say.
MemoryBudget budget_of(const Args& a, const std::string& device) {
  MemoryBudget budget = memory_at_hand(device, 0);
  if (a.has("gpu-memory")) {
    budget.gpu = gib_to_bytes(a.number("gpu-memory", 0));
    budget.gpu_source = "--gpu-memory";
  } else if (budget.gpu == 0) {
    budget.gpu_source += (budget.gpu_source.empty() ? "" : "; ") + std::string("give --gpu-memory");
  }
  if (a.has("host-memory")) {
    budget.host = gib_to_bytes(a.number("host-memory", 0));
    budget.host_source = "--host-memory";
  }
  return budget;
}

// Exit code 1 when the run does not fit, with the settings that would on stderr. With
// train.memory auto, first the line the trainer would log, and the plan of its choice.
int plan(const Args& a) {
  TrainConfig cfg = load_train_config(a.get("config"), a.all("set"));
  if (a.has("batch-size")) cfg.batch_size = a.int32("batch-size", 0);
  resolve_model(cfg);
  cfg.validate();
  const int world = world_size(a);
  const std::string device = planned_device(cfg);
  const MemoryBudget budget = budget_of(a, device);
  const PlanFunction plan_of = planner(cfg, device, world, local_ranks(a));
  if (cfg.memory == "auto") std::cout << apply_train_memory(cfg, budget, plan_of) << std::endl;
  const MemoryPlan plan = plan_of(cfg);
  std::cout << describe(cfg, plan, budget);
  if (plan.fits(budget)) return 0;
  const auto settings = settings_that_fit(cfg, device, budget, world, local_ranks(a));
  if (!settings) {
    std::cerr << "esplag: error: the run does not fit, nor with train.checkpointing full and train.batch_size 1; it "
                 "needs a smaller model, a shorter train.seq_len or more memory"
              << std::endl;
    return 1;
  }
  std::string sets;
  for (const std::string& s : *settings) sets += " --set " + s;
  std::cout << "cheapest settings that fit:" << sets << std::endl;
  std::cerr << "esplag: error: the run does not fit (the plan above says what would)" << std::endl;
  return 1;
}

}  // namespace

const Command kPlan = {
    "plan",
    "the memory a training run needs, by category, whether it fits, and what would",
    "  esplag plan --config FILE.yaml [--set key=value]... [--batch-size N] [--gpus N] [--gpu-memory GiB]\n"
    "              [--host-memory GiB]\n"
    "Prints, without allocating anything, the bytes the run of the config needs on the host (weights,\n"
    "gradients, AdamW moments, activations) and, for train.device cuda, on the GPU (in the CUDA build params,\n"
    "grads, optimizer, activations, scratch, workspace; else the model state: params, grads, optimizer), and\n"
    "whether each fits: the GPU against --gpu-memory or the free memory of the device, the host against\n"
    "--host-memory or the memory available now. A run that does not fit exits with 1 and names the cheapest\n"
    "--set assignments that would make it fit (train.checkpointing selective, then full every K blocks for K\n"
    "from model.n_layer down to 1, then a smaller train.batch_size with more train.grad_accum).\n"
    "With train.memory auto it first prints the line the run would log, what it would choose (the cheapest\n"
    "checkpointing that fits), and plans that choice; an error when none does.\n"
    "The numbers are one rank's of a data-parallel run over --gpus N ranks (default: the launcher's WORLD_SIZE,\n"
    "else 1) with train.parallel.zero (docs/distributed.md): with stage 1 each GPU keeps the AdamW moments of its\n"
    "chunk of the stored elements only (stage 2: and their mean gradient; stage 3: and its master weights, the\n"
    "blocks' bf16 weights in two slots), and a checkpoint's whole moments in\n"
    "pinned host memory are noted. The ranks on one host share its memory: the host must hold them all (all\n"
    "--gpus N ranks are local; else the launcher's LOCAL_WORLD_SIZE, ...), as the trainer checks it. The device\n"
    "is the trainer's choice: a train.device cuda run the GPU does not train (a sparse kind it lacks) is its error.",
    {
        Option::text("config", "FILE.yaml", "", "the run's config").mandatory(),
        Option::list("set", "KEY=VALUE", "override one config key, e.g. train.checkpointing=full"),
        Option::integer("batch-size", "", 1, kIntMax, "the micro-batch to plan (default: train.batch_size)"),
        Option::integer("gpus", "", 1, 1024,
                        "data-parallel ranks, one per GPU, as train --gpus N (default: the launcher's WORLD_SIZE, "
                        "else 1)"),
        gib(Option::number("gpu-memory", "", 0.001, kRealMax,
                           "GPU memory to plan against (default: the free memory of CUDA device 0)")),
        gib(Option::number("host-memory", "", 0.001, kRealMax,
                           "the host's memory to plan against, for all its ranks (default: the memory available "
                           "now)")),
    },
    plan,
};

}  // namespace esplag::cli
