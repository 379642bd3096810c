// What the trainer reports on rank 0: a progress line per log step (an
// in-place bar on a terminal), the final summary, and the --json record.
//
//   fsdp_train::Progress progress(steps, log_every);
//   progress.update({step, loss, tokens_per_s, peak_mem_bytes, seconds});
//   progress.finish();
//   fsdp_train::write_json(path, world_size, mesh, records);
//
// JSON format (one object):
//   {"world_size": N, "mesh": "...", "steps": [{"step": i, "loss": x,
//    "tokens_per_s": y, "peak_mem_bytes": z}, ...], "final_loss": x}
// Steps count from 1; "loss" is the global batch's mean loss (the average of
// the ranks' mean losses); "peak_mem_bytes" is the largest peak over ranks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace fsdp_train {

struct StepRecord {
  int64_t step = 0;
  double loss = 0;
  double tokens_per_s = 0;
  int64_t peak_mem_bytes = 0;
  double seconds = 0;
};

// Writes the --json record. Fails, naming the path, when it cannot be written.
absl::Status write_json(const std::string& path, int64_t world_size, const std::string& mesh,
                        const std::vector<StepRecord>& steps);

// "12.3 MiB", "1.50 GiB".
std::string format_bytes(int64_t bytes);
// "12,345".
std::string format_count(double value);

// Progress output on stdout: on a terminal, a bar redrawn in place every
// step; otherwise one line every `log_every` steps (and at the first and the
// last step).
class Progress {
 public:
  Progress(int64_t steps, int64_t log_every);
  void update(const StepRecord& record);
  // Ends the bar's line (on a terminal).
  void finish();

 private:
  int64_t steps_;
  int64_t log_every_;
  bool tty_;
  bool open_line_ = false;
};

}  // namespace fsdp_train
