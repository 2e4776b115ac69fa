// esplag plan: the memory a training run of a config needs, on the host and on the GPU, by
// category; whether it fits; the cheapest settings that would; and with train.memory auto
// what the run would choose. Nothing is allocated.
#include <cmath>

#include "commands.h"
#include "core/error.h"
#include "data/prepare.h"
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

// train.device, with auto as the trainer takes it when the recipe's kinds run on the GPU.
std::string planned_device(const std::string& requested) {
  if (requested != "auto") return requested;
  const DeviceProbe probe = probe_devices();
  return probe.cuda_build && probe.gpus > 0 ? "cuda" : "cpu";
}

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
  const std::string device = planned_device(cfg.device);
  const MemoryBudget budget = budget_of(a, device);
  if (cfg.memory == "auto")
    std::cout << apply_train_memory(cfg, budget, [&](const TrainConfig& c) { return plan_memory(c, device); })
              << std::endl;
  const MemoryPlan plan = plan_memory(cfg, device);
  std::cout << describe(cfg, plan, budget);
  if (plan.fits(budget)) return 0;
  const auto settings = settings_that_fit(cfg, device, budget);
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
    "  esplag plan --config FILE.yaml [--set key=value]... [--batch-size N] [--gpu-memory GiB] [--host-memory GiB]\n"
    "Prints, without allocating anything, the bytes the run of the config needs on the host (weights,\n"
    "gradients, AdamW moments, activations) and, for train.device cuda in the CUDA build, on the GPU (params,\n"
    "grads, optimizer, activations, scratch, workspace), and whether each fits: the GPU against --gpu-memory\n"
    "or the free memory of the device, the host against --host-memory or the memory available now. A run\n"
    "that does not fit exits with 1 and names the cheapest --set assignments that would make it fit\n"
    "(train.checkpointing selective, then full every K blocks for K from model.n_layer down to 1, then a smaller\n"
    "train.batch_size with more train.grad_accum). With train.memory auto it first prints the line the run would\n"
    "log, what it would choose (the cheapest checkpointing that fits), and plans that choice; an error when none does.",
    {
        Option::text("config", "FILE.yaml", "", "the run's config").mandatory(),
        Option::list("set", "KEY=VALUE", "override one config key, e.g. train.checkpointing=full"),
        Option::integer("batch-size", "", 1, kIntMax, "the micro-batch to plan (default: train.batch_size)"),
        gib(Option::number("gpu-memory", "", 0.001, kRealMax,
                           "GPU memory to plan against (default: the free memory of CUDA device 0)")),
        gib(Option::number("host-memory", "", 0.001, kRealMax,
                           "host memory to plan against (default: the memory available now)")),
    },
    plan,
};

}  // namespace esplag::cli
