#include "train/distill_teacher.h"

#include <filesystem>

#include "core/error.h"
#include "train/checkpoint.h"

namespace esplag {

std::unique_ptr<Transformer<float>> load_teacher(const Recipe::Modifier& distill, const std::string& where,
                                                 const ModelConfig& student, const std::string& student_tokenizer,
                                                 int seq_len) {
  const std::string& dir = distill.teacher;
  // A resumed run reloads the teacher from the path its config saved: say so when it is gone.
  ESPLAG_CHECK(std::filesystem::is_directory(dir), where, ": key 'teacher': '", dir,
               "' is not a directory (the teacher's checkpoint or run directory must stay in place for the whole "
               "run, resumes included)");
  CheckpointContents info;
  std::unique_ptr<Transformer<float>> teacher;
  try {
    teacher = load_model(resolve_checkpoint(dir), &info);
  } catch (const Error& e) {
    fail(where, ": key 'teacher': ", e.what());
  }
  const int teacher_vocab = teacher->config().vocab_size;
  ESPLAG_CHECK(teacher_vocab == student.vocab_size, where, ": key 'teacher': the teacher '", dir,
               "' has a vocabulary of ", teacher_vocab, " tokens, the student (model.vocab_size) ", student.vocab_size,
               "; distillation compares their logits token by token, so they must be equal");
  const int teacher_len = teacher->config().max_seq_len;
  ESPLAG_CHECK(seq_len <= teacher_len, where, ": key 'teacher': the teacher '", dir, "' takes sequences of at most ",
               teacher_len, " tokens (its model.max_seq_len), the run's train.seq_len is ", seq_len);
  ESPLAG_CHECK(same_tokenizer(info.tokenizer, student_tokenizer), where, ": key 'teacher': the teacher '", dir,
               "' was trained with tokenizer '", info.tokenizer, "', the student's data with '", student_tokenizer,
               "'; distillation needs the same tokenizer");
  return teacher;
}

}  // namespace esplag
