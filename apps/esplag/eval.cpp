// esplag eval: loss and perplexity of a checkpoint on a data split.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "core/error.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace esplag::cli {

namespace {

int eval(const Args& a) {
  const std::string ck = resolve_checkpoint(a.get("checkpoint"));
  const std::string data = a.get("data", read_checkpoint_info(ck).config.data_path);
  const std::string split = a.get("split");
  ESPLAG_CHECK(split == "val" || split == "train", "eval: --split must be val or train, got '", split, "'");
  const EvalResult r = evaluate_checkpoint(ck, data, split, a.int32("batches", 0), a.int32("batch", 0),
                                           a.int32("seq", 0), a.get("device"));
  if (a.has("json")) {
    std::cout << nlohmann::json{{"checkpoint", ck}, {"data", data},       {"split", split},
                                {"loss", r.loss},   {"perplexity", r.perplexity}, {"batches", r.batches},
                                {"tokens", r.tokens},  {"device", r.device}}
                     .dump()
              << std::endl;
  } else {
    std::printf("%s on %s/%s: loss %.4f | perplexity %.3f | %d batches, %lld tokens | device %s\n", ck.c_str(),
                data.c_str(), split.c_str(), r.loss, r.perplexity, r.batches, static_cast<long long>(r.tokens),
                r.device.c_str());
  }
  return 0;
}

}  // namespace

const Command kEval = {
    "eval",
    "loss and perplexity of a checkpoint on a data split",
    "",
    {
        Option::text("checkpoint", "DIR", "", "a run directory (its latest checkpoint) or a step-NNNNNN directory")
            .mandatory(),
        Option::text("data", "DIR", "", "the dataset (default: data.path of the checkpoint's config)"),
        Option::text("split", "val|train", "val", "the split to evaluate"),
        Option::integer("batches", "", 1, kIntMax, "batches to average (default: the whole split)"),
        Option::integer("batch", "", 1, kIntMax, "sequences per batch (default: train.batch_size of the checkpoint)"),
        Option::integer("seq", "", 1, kIntMax, "tokens per sequence (default: train.seq_len of the checkpoint)"),
        Option::text("device", "auto|cpu|cuda", "auto", "where to evaluate (auto: the GPU when it can run the model)"),
        Option::flag("json", "print one JSON object instead of a line of text"),
    },
    eval,
};

}  // namespace esplag::cli
