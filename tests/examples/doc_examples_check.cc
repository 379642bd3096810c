// Checks that the C++ examples in the documentation are code the build
// compiles: every ```cpp block in README.md and docs/*.md, and every marked
// example in a public header's comments, must be an excerpt of a source file
// that CI compiles (an examples/ program that a test runs, or a tool).
//
//   doc_examples_check SOURCE_ROOT
//
// Marking, in Markdown, on the line before the block:
//   <!-- example: examples/fully_shard_basic.cc -->
//   ```cpp
// and in a header comment, on the line that introduces the indented code:
//   // Shard the blocks, then the root (examples/fully_shard_basic.cc):
//   //
//   //   fsdp::fully_shard(block, opts);
// The header's example ends at the first blank comment line ("//").
// A header may quote examples/, tools/, tests/ or a layer's src/ (all
// compiled). An excerpt matches when its lines appear in the file in the same order,
// consecutive except where the excerpt has a line "..." (or "// ..."), which
// skips any number of lines. Indentation, runs of spaces and blank lines do
// not count. Prints every mismatch with the line that differs; exit 1 if
// any, 0 with a count otherwise.
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

struct Excerpt {
  std::string where;   // file:line of the block
  std::string source;  // the path it quotes, relative to the root
  std::vector<std::string> lines;
};

std::string normalize(const std::string& line) {
  std::string out;
  bool space = false;
  for (char c : line) {
    if (c == ' ' || c == '\t' || c == '\r') {
      space = !out.empty();
      continue;
    }
    if (space) out += ' ';
    space = false;
    out += c;
  }
  return out;
}

bool is_gap(const std::string& normalized) { return normalized == "..." || normalized == "// ..."; }

std::vector<std::string> read_lines(const fs::path& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

void markdown_excerpts(const fs::path& root, const fs::path& file, std::vector<Excerpt>& out,
                       std::vector<std::string>& errors) {
  const std::vector<std::string> lines = read_lines(file);
  const std::string name = fs::relative(file, root).string();
  static const std::regex kMarker(R"(^\s*<!--\s*(example|excerpt):\s*(\S+)\s*-->\s*$)");
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string fence = normalize(lines[i]);
    if (!starts_with(fence, "```")) continue;
    const bool cpp = fence == "```cpp" || fence == "```c++" || fence == "```cc";
    size_t end = i + 1;
    while (end < lines.size() && !starts_with(normalize(lines[end]), "```")) ++end;
    if (cpp) {
      std::smatch m;
      const std::string where = name + ":" + std::to_string(i + 1);
      if (i > 0 && std::regex_match(lines[i - 1], m, kMarker)) {
        out.push_back(Excerpt{where, m[2], std::vector<std::string>(lines.begin() + i + 1, lines.begin() + end)});
      } else {
        errors.push_back(where +
                         ": a ```cpp block that no build compiles. Put the code in a compiled file (examples/) and "
                         "mark the block with <!-- example: examples/NAME.cc --> on the line before it, or quote "
                         "compiled code with <!-- excerpt: PATH -->.");
      }
    }
    i = end;
  }
}

void header_excerpts(const fs::path& root, const fs::path& file, std::vector<Excerpt>& out) {
  const std::vector<std::string> lines = read_lines(file);
  const std::string name = fs::relative(file, root).string();
  static const std::regex kMarker(R"(^//.*\(((?:examples|tools|tests|[a-z_]+/src)/[^()\s]+)\):\s*$)");
  for (size_t i = 0; i < lines.size(); ++i) {
    std::smatch m;
    if (!std::regex_match(lines[i], m, kMarker)) continue;
    Excerpt e{name + ":" + std::to_string(i + 1), m[1], {}};
    size_t k = i + 1;
    while (k < lines.size() && lines[k] == "//") ++k;
    // The example ends at the first blank comment line.
    for (; k < lines.size() && starts_with(lines[k], "//  "); ++k) e.lines.push_back(lines[k].substr(2));
    out.push_back(std::move(e));
    i = k;
  }
}

// Empty when `e` is an excerpt of its source, else what went wrong.
std::string check(const fs::path& root, const Excerpt& e) {
  const fs::path source = root / e.source;
  if (!fs::is_regular_file(source)) return e.where + ": quotes " + e.source + ", which does not exist";
  std::vector<std::string> file;
  for (const auto& line : read_lines(source)) {
    std::string n = normalize(line);
    if (!n.empty()) file.push_back(std::move(n));
  }
  std::vector<std::vector<std::string>> segments(1);
  for (const auto& line : e.lines) {
    const std::string n = normalize(line);
    if (n.empty()) continue;
    if (is_gap(n)) {
      segments.emplace_back();
    } else {
      segments.back().push_back(n);
    }
  }
  size_t lines_checked = 0;
  size_t cursor = 0;
  for (const auto& segment : segments) {
    if (segment.empty()) continue;
    lines_checked += segment.size();
    size_t best_start = 0, best = 0;
    bool found = false;
    for (size_t start = cursor; start + segment.size() <= file.size() && !found; ++start) {
      size_t matched = 0;
      while (matched < segment.size() && file[start + matched] == segment[matched]) ++matched;
      if (matched == segment.size()) {
        cursor = start + matched;
        found = true;
      } else if (matched > best) {
        best = matched;
        best_start = start;
      }
    }
    if (!found) {
      std::string message =
          e.where + ": this line of the example is not in " + e.source + " (in this order):\n    " + segment[best];
      if (best > 0 && best_start + best < file.size()) message += "\n  the file has:\n    " + file[best_start + best];
      return message;
    }
  }
  if (lines_checked == 0) return e.where + ": an empty example";
  return "";
}

}  // namespace

int run(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: doc_examples_check SOURCE_ROOT\n");
    return 2;
  }
  const fs::path root = argv[1];
  std::vector<Excerpt> excerpts;
  std::vector<std::string> errors;
  int files = 0;
  std::vector<fs::path> markdown = {root / "README.md"};
  for (const auto& entry : fs::directory_iterator(root / "docs")) {
    if (entry.path().extension() == ".md") markdown.push_back(entry.path());
  }
  for (const auto& path : markdown) {
    markdown_excerpts(root, path, excerpts, errors);
    ++files;
  }
  for (const auto& layer : fs::directory_iterator(root)) {
    const fs::path include = layer.path() / "include";
    if (!layer.is_directory() || !fs::is_directory(include)) continue;
    for (const auto& entry : fs::recursive_directory_iterator(include)) {
      if (entry.path().extension() != ".h") continue;
      header_excerpts(root, entry.path(), excerpts);
      ++files;
    }
  }
  for (const auto& e : excerpts) {
    if (std::string problem = check(root, e); !problem.empty()) errors.push_back(problem);
  }
  for (const auto& error : errors) std::fprintf(stderr, "%s\n", error.c_str());
  if (!errors.empty()) {
    std::fprintf(stderr, "doc_examples_check: %zu problem(s) in the examples of %d files\n", errors.size(), files);
    return 1;
  }
  std::printf("doc_examples_check: %zu examples in %d files match the compiled sources they quote\n", excerpts.size(),
              files);
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // an unreadable tree, a bad path
    std::fprintf(stderr, "doc_examples_check: %s\n", e.what());
    return 2;
  }
}
