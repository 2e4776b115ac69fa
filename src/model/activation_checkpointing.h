// Activation checkpointing of the CPU Transformer: which transformer blocks keep less of
// their forward for the backward and recompute the rest there (docs/config.md,
// train.checkpointing). Gradients are bit-identical to keeping everything.
//   none       every block keeps everything its backward reads
//   full       a checkpointed block keeps only its output (the next block's input; its own
//              input is the previous block's output, kept as well) and its backward first
//              runs its forward again, up to the MLP activation
//   selective  a checkpointed block keeps the outputs of its Linear layers (q, k, v after
//              RoPE, the attention output that feeds attn.proj, fc) and the residual
//              stream, and recomputes the norms with their statistics, the attention's
//              probabilities and the MLP activation
// Blocks 0, every, 2·every, ... are checkpointed (every = 1: all of them).
#pragma once
#include <string>

namespace esplag {

enum class CheckpointMode { none, full, selective };

CheckpointMode checkpoint_mode_from(const std::string& s);  // throws naming train.checkpointing
std::string to_string(CheckpointMode m);

struct ActivationCheckpointing {
  CheckpointMode mode = CheckpointMode::none;
  int every = 1;
  bool checkpoints(int layer) const { return mode != CheckpointMode::none && layer % every == 0; }
};

}  // namespace esplag
