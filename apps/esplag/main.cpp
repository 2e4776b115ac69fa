// esplag: the command-line front end. Finds the command named by the first words, parses
// its options against its table (args.h), prints its help or runs it. Every error reaches
// main() as an esplag::Error and becomes one line on stderr with a non-zero exit code.
#include <algorithm>
#include <iostream>
#include <sstream>

#include "args.h"
#include "commands.h"
#include "core/error.h"
#include "core/parallel.h"

using namespace esplag;
using namespace esplag::cli;

namespace {

const std::vector<const Command*>& all_commands() {
  static const std::vector<const Command*> commands = [] {
    std::vector<const Command*> c = {&kDataPrepare, &kTokenizerTrain, &kTrain,  &kPlan,   &kEval,  &kSample,
                                     &kProfile,     &kSparsity,       &kExport, &kImport};
    for (const Command* b : bench_commands()) c.push_back(b);
    return c;
  }();
  return commands;
}

// The commands whose names start with `group` ("" for all), one line each.
std::string overview(const std::string& group) {
  std::ostringstream os;
  size_t width = 0;
  for (const Command* c : all_commands()) width = std::max(width, c->name.size());
  for (const Command* c : all_commands())
    if (group.empty() || c->name.rfind(group + " ", 0) == 0)
      os << "  esplag " << c->name << std::string(width - c->name.size(), ' ') << "  " << c->summary << "\n";
  return os.str();
}

std::string usage() {
  std::string common;
  for (const Option& o : common_options()) common += "  --" + o.name + " " + o.value + "  " + o.help + "\n";
  return "esplag — sparse-aware transformer LM training\n\ncommands:\n" + overview("") +
         "  esplag --version\n\n`esplag COMMAND --help` shows a command's options, their ranges and defaults.\n"
         "common options (before or after the command):\n" + common;
}

// Removes the common options (--threads N or --threads=N) from `args` and applies them.
void take_common_options(std::vector<std::string>& args) {
  const Option& threads = common_options().front();
  for (size_t i = 0; i < args.size(); ++i) {
    std::string value;
    if (args[i] == "--threads") {
      ESPLAG_CHECK(i + 1 < args.size(), "--threads needs a value (", threads.value, ")");
      value = args[i + 1];
      args.erase(args.begin() + i, args.begin() + i + 2);
    } else if (args[i].rfind("--threads=", 0) == 0) {
      value = args[i].substr(10);
      args.erase(args.begin() + i);
    } else {
      continue;
    }
    set_num_threads(static_cast<int>(parse_integer("", threads, value)));
    return;
  }
}

// The command named by the first words of `args` (longest name first), or null.
const Command* find_command(const std::vector<std::string>& args, size_t& words) {
  const Command* found = nullptr;
  words = 0;
  for (const Command* c : all_commands()) {
    std::istringstream name(c->name);
    size_t n = 0;
    bool match = true;
    for (std::string w; name >> w; ++n) match = match && n < args.size() && args[n] == w;
    if (match && n > words) {
      found = c;
      words = n;
    }
  }
  return found;
}

bool is_help(const std::string& a) { return a == "--help" || a == "-h" || a == "help"; }

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    take_common_options(args);
    if (args.empty() || is_help(args[0])) {
      std::cout << usage();
      return args.empty() ? 2 : 0;
    }
    if (args[0] == "--version") {
      std::cout << "esplag " << ESPLAG_VERSION << std::endl;
      return 0;
    }
    size_t words = 0;
    const Command* command = find_command(args, words);
    if (!command) {
      // A group of subcommands (data, tokenizer, bench): its list, as help or with the error.
      const std::string list = overview(args[0]);
      if (list.empty()) {
        std::cerr << "esplag: unknown command '" << args[0] << "' (see esplag --help)" << std::endl;
        return 2;
      }
      if (args.size() > 1 && is_help(args[1])) {
        std::cout << "esplag " << args[0] << " subcommands (esplag " << args[0] << " SUBCOMMAND --help for one):\n"
                  << list;
        return 0;
      }
      fail(args[0], ": ", args.size() == 1 ? "missing subcommand" : "unknown subcommand '" + args[1] + "'",
           "; one of:\n", list.substr(0, list.size() - 1));
    }
    const Args a({args.begin() + words, args.end()}, *command);
    if (a.help()) {
      std::cout << help_text(*command);
      return 0;
    }
    return command->run(a);
  } catch (const Error& e) {
    std::cerr << "esplag: error: " << e.what() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "esplag: unexpected error: " << e.what() << std::endl;
    return 1;
  }
}
