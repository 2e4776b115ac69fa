#include "local_ranks.h"

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "core/error.h"
#include "dist/launch.h"
#include "dist/world.h"

namespace esplag::cli {

namespace {

// Whether option `name` of `command` or a common option takes a value ("--name VALUE").
bool takes_value(const Command& command, const std::string& name) {
  for (const auto* options : {&command.options, &common_options()})
    for (const Option& o : *options)
      if (o.name == name) return o.type != Option::Type::flag;
  return false;
}

// This process's command line (/proc/self/cmdline) without --gpus and its value: what each rank runs.
std::vector<std::string> command_line_without_gpus(const Command& command) {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ESPLAG_CHECK(!text.empty(), command.name, " --gpus: cannot read this command line from /proc/self/cmdline");
  std::vector<std::string> words;
  for (size_t start = 0, end; start < text.size(); start = end + 1) {
    end = text.find('\0', start);
    if (end == std::string::npos) end = text.size();
    words.push_back(text.substr(start, end - start));
  }
  std::vector<std::string> argv = {words[0]};
  for (size_t i = 1; i < words.size(); ++i) {
    const std::string& w = words[i];
    if (w == "--gpus") {
      ++i;  // and its value
    } else if (w.rfind("--gpus=", 0) != 0) {
      argv.push_back(w);
      // A value that looks like an option ("--out --gpus") stays a value.
      const bool option = w.rfind("--", 0) == 0 && w.find('=') == std::string::npos;
      if (option && takes_value(command, w.substr(2)) && i + 1 < words.size()) argv.push_back(words[++i]);
    }
  }
  return argv;
}

}  // namespace

int run_as_local_ranks(const Command& command, int gpus) {
  const World world = world_from_env();
  ESPLAG_CHECK(!std::getenv("RANK") && !world.distributed(), command.name, ": --gpus ", gpus,
               " starts its own processes, but this one already is ", world.describe(),
               "; drop --gpus when torchrun, mpirun or srun starts the ranks");
  return launch_local_ranks(command_line_without_gpus(command), gpus);
}

}  // namespace esplag::cli
