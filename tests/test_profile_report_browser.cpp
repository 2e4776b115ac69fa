// report.html in a real browser: a report from a small profiled run (with a validation
// section) opens in headless Chromium without a script error, its script marks the DOM
// with data-rendered="1" after checking that every chart drew, and a screenshot of it is
// a full-size, non-blank image (decoded by the browser itself). Chromium is optional
// (scripts/setup.sh installs it unless --no-browser; ESPLAG_CHROMIUM names another
// binary): without it these tests are skipped, and ctest names them among the tests that
// did not run. Control cases show that each check can fail.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "cli_util.h"
#include "profile/profiler.h"
#include "profile/validate.h"

namespace fs = std::filesystem;
using namespace esplag;

namespace {

using esplag::testing::read_text;
using esplag::testing::write_text;

const fs::path& scratch() { return esplag::testing::scratch_root("test_browser"); }

bool executable(const fs::path& p) { return ::access(p.c_str(), X_OK) == 0 && fs::is_regular_file(p); }

// The browser: $ESPLAG_CHROMIUM, else the first of the usual names on PATH; "" if none.
std::string find_chromium() {
  if (const char* env = std::getenv("ESPLAG_CHROMIUM"); env && *env) return env;
  const char* path = std::getenv("PATH");
  if (!path) return "";
  for (const char* name : {"chromium", "chromium-browser", "google-chrome", "google-chrome-stable"}) {
    std::stringstream dirs(path);
    std::string dir;
    while (std::getline(dirs, dir, ':'))
      if (!dir.empty() && executable(fs::path(dir) / name)) return (fs::path(dir) / name).string();
  }
  return "";
}

// Skips the test when no browser is found; a browser named by ESPLAG_CHROMIUM must exist.
#define REQUIRE_CHROMIUM(var)                                                                            \
  const std::string var = find_chromium();                                                               \
  if (var.empty())                                                                                       \
    GTEST_SKIP() << "headless Chromium was not found on PATH: install it (apt-get install chromium; "    \
                    "scripts/setup.sh does unless --no-browser) or set ESPLAG_CHROMIUM";                 \
  ASSERT_TRUE(executable(var)) << "ESPLAG_CHROMIUM='" << var << "' is not an executable file"

struct BrowserRun {
  int code = -1;
  std::string out;  // stdout (the DOM with --dump-dom)
  std::string log;  // stderr (console messages with --enable-logging=stderr)
};

// One headless Chromium run on `page` with `mode` (--dump-dom or --screenshot=FILE).
BrowserRun browse(const std::string& chromium, const fs::path& page, const std::string& mode) {
  static std::atomic<int> counter{0};
  const int n = counter++;
  const fs::path out = scratch() / ("browser-" + std::to_string(n) + ".out");
  const fs::path err = scratch() / ("browser-" + std::to_string(n) + ".err");
  const fs::path profile = scratch() / ("browser-profile-" + std::to_string(n));
  const std::string cmd = "timeout 180 '" + chromium +
                          "' --headless --disable-gpu --no-sandbox --hide-scrollbars --no-first-run "
                          "--user-data-dir='" + profile.string() +
                          "' --window-size=1400,2000 --enable-logging=stderr --v=0 " + mode + " 'file://" +
                          fs::absolute(page).string() + "'";
  const esplag::testing::CommandResult c = esplag::testing::run_command(cmd, out, err);
  BrowserRun r;
  r.code = c.code;
  r.out = c.out;
  r.log = c.err;
  return r;
}

// Console lines that report a script error.
std::vector<std::string> script_errors(const std::string& log) {
  std::vector<std::string> errors;
  std::istringstream is(log);
  std::string line;
  while (std::getline(is, line))
    if (line.find("Uncaught") != std::string::npos ||
        (line.find("CONSOLE") != std::string::npos && line.find("rror") != std::string::npos))
      errors.push_back(line);
  return errors;
}

// The value of attribute `name` on <body> in a dumped DOM ("" if absent).
std::string body_attribute(const std::string& dom, const std::string& name) {
  std::smatch m;
  if (!std::regex_search(dom, m, std::regex("<body[^>]*>"))) return "";
  const std::string body = m.str();
  if (!std::regex_search(body, m, std::regex(" " + name + "=\"([^\"]*)\""))) return "";
  return m[1].str();
}

std::string base64(const std::string& bytes) {
  static const char* k = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const uint32_t v = (uint8_t(bytes[i]) << 16) | (uint8_t(bytes[i + 1]) << 8) | uint8_t(bytes[i + 2]);
    out += k[v >> 18];
    out += k[(v >> 12) & 63];
    out += k[(v >> 6) & 63];
    out += k[v & 63];
  }
  if (i + 1 == bytes.size()) {
    const uint32_t v = uint8_t(bytes[i]) << 16;
    out += k[v >> 18];
    out += k[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == bytes.size()) {
    const uint32_t v = (uint8_t(bytes[i]) << 16) | (uint8_t(bytes[i + 1]) << 8);
    out += k[v >> 18];
    out += k[(v >> 12) & 63];
    out += k[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

struct PngInfo {
  bool valid = false;
  uint32_t width = 0, height = 0;
};

PngInfo png_header(const std::string& bytes) {
  PngInfo p;
  const std::string sig = "\x89PNG\r\n\x1a\n";
  if (bytes.size() < 24 || bytes.compare(0, 8, sig) != 0 || bytes.compare(12, 4, "IHDR") != 0) return p;
  auto be32 = [&](size_t at) {
    return (uint32_t(uint8_t(bytes[at])) << 24) | (uint32_t(uint8_t(bytes[at + 1])) << 16) |
           (uint32_t(uint8_t(bytes[at + 2])) << 8) | uint32_t(uint8_t(bytes[at + 3]));
  };
  p.valid = true;
  p.width = be32(16);
  p.height = be32(20);
  return p;
}

// What the browser sees in a PNG: its size, how many pixels differ from the top-left one
// (the background), and how many distinct colours (4 bits per channel) it has.
struct Pixels {
  std::string size;
  long differ = -1;
  long colours = -1;
};

Pixels analyse_png(const std::string& chromium, const fs::path& png) {
  const fs::path page = scratch() / (png.stem().string() + "-pixels.html");
  write_text(page, "<!DOCTYPE html><html><body><img id=\"shot\" src=\"data:image/png;base64," +
                       base64(read_text(png)) + R"HTML(">
<script>
var img = document.getElementById('shot');
img.addEventListener('load', function () {
  var c = document.createElement('canvas');
  c.width = img.naturalWidth;
  c.height = img.naturalHeight;
  var ctx = c.getContext('2d');
  ctx.drawImage(img, 0, 0);
  var d = ctx.getImageData(0, 0, c.width, c.height).data;
  var differ = 0, colours = {};
  for (var i = 0; i < d.length; i += 4) {
    if (d[i] !== d[0] || d[i + 1] !== d[1] || d[i + 2] !== d[2]) differ++;
    colours[(d[i] >> 4) * 256 + (d[i + 1] >> 4) * 16 + (d[i + 2] >> 4)] = 1;
  }
  document.body.setAttribute('data-size', c.width + 'x' + c.height);
  document.body.setAttribute('data-differ', String(differ));
  document.body.setAttribute('data-colours', String(Object.keys(colours).length));
});
</script></body></html>)HTML");
  const BrowserRun r = browse(chromium, page, "--dump-dom");
  Pixels p;
  p.size = body_attribute(r.out, "data-size");
  const std::string differ = body_attribute(r.out, "data-differ");
  const std::string colours = body_attribute(r.out, "data-colours");
  if (!differ.empty()) p.differ = std::stol(differ);
  if (!colours.empty()) p.colours = std::stol(colours);
  return p;
}

void sleep_us(int us) { std::this_thread::sleep_for(std::chrono::microseconds(us)); }

// A small profiled run with a validation: a dense and a "sparse" step of host ops on two
// threads (the second labelled stream 1), several categories and layers, one changed
// module "blocks.0.mlp.fc" whose sparse version adds a helper op and runs faster.
struct SmallRun {
  ProfileResult result;
  ValidationResult validation;
};

SmallRun small_profiled_run() {
  int X, H[2], A[2], Y[2], G, L;
  auto step = [&](bool sparse) {
    ScopedOp top("step", OpCategory::other);
    { ScopedOp op("embed.fwd", OpCategory::elementwise, -1, 1e6, 4e6, {}, {&X}); sleep_us(300); }
    std::thread side([&] {
      ScopedOp op("grad.allreduce", OpCategory::comm, -1, 0, 8e6, {}, {&G}, 1);
      sleep_us(900);
    });
    for (int l = 0; l < 2; ++l) {
      const std::string p = "blocks." + std::to_string(l);
      { ScopedOp op({p, "ln1.fwd"}, OpCategory::norm, l, 1e5, 1e5, {l ? &Y[0] : &X}, {&H[l]}); sleep_us(100); }
      { ScopedOp op({p, "attn.sdpa.fwd"}, OpCategory::attention, l, 4e7, 1e6, {&H[l]}, {&A[l]}); sleep_us(500); }
      if (sparse && l == 0) {
        { ScopedOp op({p, "mlp.fc.sparsify"}, OpCategory::other, l, 0, 1e6, {}, {}); sleep_us(100); }
        ScopedOp op({p, "mlp.fc.fwd"}, OpCategory::sparse_gemm, l, 1e8, 2e6, {&A[l]}, {&Y[l]});
        sleep_us(300);
      } else {
        ScopedOp op({p, "mlp.fc.fwd"}, OpCategory::dense_gemm, l, 2e8, 3e6, {&A[l]}, {&Y[l]});
        sleep_us(600);
      }
    }
    { ScopedOp op("lm_head.cross_entropy", OpCategory::loss, -1, 1e6, 1e6, {&Y[1]}, {&L}); sleep_us(200); }
    side.join();
    { ScopedOp op("adamw", OpCategory::optimizer, -1, 1e6, 1e6, {&L, &G}, {}); sleep_us(200); }
  };
  Profiler p;
  const ValidationSteps st = run_validation_steps(p, [&] { step(false); }, [&] { step(true); }, ValidationPlan{0, 2, 3});
  SmallRun run;
  run.validation = validate_prediction(
      st.dense, st.sparse, speedups_from_calibration(st.calibration_dense, st.calibration_sparse, {"blocks.0.mlp.fc"}));
  run.result = Profiler::analyse(st.dense[run.validation.dense_step], run.validation.model.specs);
  return run;
}

const fs::path& report_page() {
  static const fs::path page = [] {
    const SmallRun run = small_profiled_run();
    const fs::path dir = scratch() / "report";
    write_reports(dir.string(), run.result, &run.validation);
    return dir / "report.html";
  }();
  return page;
}

int count_of(const std::string& s, const std::string& needle) {
  int n = 0;
  for (size_t p = s.find(needle); p != std::string::npos; p = s.find(needle, p + 1)) ++n;
  return n;
}

}  // namespace

TEST(ReportInBrowser, ScriptsRunWithoutErrorsAndEveryChartDraws) {
  REQUIRE_CHROMIUM(chromium);
  const std::string html = read_text(report_page());
  ASSERT_NE(html.find("Validation: predicted vs measured"), std::string::npos);
  const BrowserRun r = browse(chromium, report_page(), "--dump-dom");
  ASSERT_EQ(r.code, 0) << r.log;
  EXPECT_TRUE(script_errors(r.log).empty()) << r.log;
  EXPECT_EQ(body_attribute(r.out, "data-rendered"), "1") << r.out.substr(0, 2000);
  const int charts = count_of(html, "<svg ");
  EXPECT_GE(charts, 6);  // category, layer, timeline, what-if, two validation charts
  EXPECT_EQ(body_attribute(r.out, "data-charts"), std::to_string(charts));
  EXPECT_EQ(body_attribute(r.out, "data-charts-drawn"), std::to_string(charts));
  // The script made the tables sortable.
  EXPECT_NE(r.out.find("click to sort"), std::string::npos);
}

TEST(ReportInBrowser, ScreenshotIsAFullNonBlankPage) {
  REQUIRE_CHROMIUM(chromium);
  const fs::path png = scratch() / "report.png";
  const BrowserRun r = browse(chromium, report_page(), "--screenshot=" + png.string());
  ASSERT_EQ(r.code, 0) << r.log;
  EXPECT_TRUE(script_errors(r.log).empty()) << r.log;
  ASSERT_TRUE(fs::exists(png)) << r.log;
  const std::string bytes = read_text(png);
  EXPECT_GT(bytes.size(), 20000u);  // a blank 1400x2000 page compresses to a few KB
  const PngInfo info = png_header(bytes);
  ASSERT_TRUE(info.valid);
  EXPECT_EQ(info.width, 1400u);
  EXPECT_EQ(info.height, 2000u);
  const Pixels px = analyse_png(chromium, png);
  EXPECT_EQ(px.size, "1400x2000");
  EXPECT_GT(px.differ, 1400L * 2000 / 50) << "under 2% of the pixels differ from the background";
  EXPECT_GE(px.colours, 12) << "too few colours for the charts";
}

TEST(ReportInBrowser, ControlsTheChecksCanFail) {
  REQUIRE_CHROMIUM(chromium);
  // A page whose script throws: the error is in the log and the marker is missing.
  const fs::path bad = scratch() / "bad.html";
  write_text(bad, "<!DOCTYPE html><html><body><svg class=\"chart\" width=\"10\" height=\"10\"></svg><script>"
                  "document.body.setAttribute('data-charts', '1'); no_such_function();"
                  "document.body.setAttribute('data-rendered', '1');</script></body></html>");
  const BrowserRun r = browse(chromium, bad, "--dump-dom");
  EXPECT_FALSE(script_errors(r.log).empty()) << r.log;
  EXPECT_EQ(body_attribute(r.out, "data-charts"), "1");
  EXPECT_EQ(body_attribute(r.out, "data-rendered"), "");
  // The report's own check: a chart with nothing drawn gives data-rendered="0".
  std::string html = read_text(report_page());
  const size_t svg = html.find("<svg ");
  ASSERT_NE(svg, std::string::npos);
  const size_t end = html.find("</svg>", svg);
  html.replace(svg, end - svg, "<svg class=\"chart\" width=\"100\" height=\"20\">");
  const fs::path empty_chart = scratch() / "empty-chart.html";
  write_text(empty_chart, html);
  const BrowserRun e = browse(chromium, empty_chart, "--dump-dom");
  EXPECT_EQ(body_attribute(e.out, "data-rendered"), "0");
  // A blank page: no pixel differs.
  const fs::path blank = scratch() / "blank.html";
  write_text(blank, "<!DOCTYPE html><html><body style=\"background:#fff\"></body></html>");
  const fs::path png = scratch() / "blank.png";
  browse(chromium, blank, "--screenshot=" + png.string());
  ASSERT_TRUE(fs::exists(png));
  const Pixels px = analyse_png(chromium, png);
  EXPECT_EQ(px.size, "1400x2000");
  EXPECT_EQ(px.differ, 0);
  EXPECT_EQ(px.colours, 1);
}
