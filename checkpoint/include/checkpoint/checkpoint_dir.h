// Atomic, verifiable checkpoint directories: ROOT/step-N, each with a
// manifest written last.
//
// A save writes into ROOT/.tmp-step-N; commit() then (collectively) records
// every file's size and CRC32 in ROOT/.tmp-step-N/manifest.json and renames
// the directory to ROOT/step-N, fsyncing the files, the manifest and ROOT.
// A process killed at any point before the rename leaves ROOT/.tmp-step-N
// behind, which loaders ignore: the previous checkpoint stays the newest
// complete one.
//
//   fsdp::checkpoint::CheckpointWriter ckpt(root, step, world_group);
//   ckpt.record(fsdp::checkpoint::save_sharded(model_sd, ckpt.subdir("model"), rank));
//   ckpt.record(fsdp::checkpoint::save_sharded(optim_sd, ckpt.subdir("optim"), rank));
//   std::string final_dir = ckpt.commit(R"({"param_groups": [...], "data_position": 1234})");
//   if (rank == 0) fsdp::checkpoint::prune_checkpoints(root, /*keep=*/3);
//
//   // resume:
//   if (auto latest = fsdp::checkpoint::find_latest_checkpoint(root)) {
//     auto manifest = fsdp::checkpoint::verify_checkpoint(latest->path);   // sizes + CRC32
//     fsdp::checkpoint::load_sharded(model_sd, latest->path + "/model");
//     ... manifest.extra_json ...
//   }
//
// manifest.json:
//   {"format": "fsdp2cpp-checkpoint", "version": 1, "step": N,
//    "world_size": W, "mesh": "<caller's text>", "checksum": "crc32-zlib",
//    "files": [{"path": "model/shard-00001-...safetensors", "size": S, "crc32": "1a2b3c4d"}, ...],
//    "extra": <the caller's JSON object>}
// The checksum is zlib's crc32 (Python: zlib.crc32(data) & 0xffffffff), as
// lowercase 8-digit hex. Paths are relative, '/'-separated plain names.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "checkpoint/sharded.h"
#include "collectives/communicator.h"

namespace fsdp::checkpoint {

inline constexpr const char* kManifestFileName = "manifest.json";

struct CheckpointWriterOptions {
  // fsync the manifest, the directories and the files not written by this
  // layer's writers (which fsync their own).
  bool fsync = true;
  // A description of the mesh at save ("2x2 (replicate, shard)"), stored in
  // the manifest for humans and for the caller's resharding decisions.
  std::string mesh;
  // How long commit() waits for the other ranks.
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
};

// The name of step N's directory ("step-N") and its temporary name (".tmp-step-N").
std::string checkpoint_dir_name(int64_t step);
std::string checkpoint_temp_dir_name(int64_t step);

// CheckpointWriter: one checkpoint being written, by every rank of `group`.
//
// Construction is collective over `group`: rank 0 removes a stale
// ROOT/.tmp-step-N, creates ROOT (mkdir -p) and the temporary directory, and
// the ranks synchronise. The object is the transaction: destroyed without
// commit(), it leaves the temporary directory (ignored by loaders, removed by
// the next writer of the same step or by prune_checkpoints).
// Not thread-safe.
class CheckpointWriter {
 public:
  // REQUIRES: every rank passes the same root and step.
  // Throws: c10::Error naming the directory on I/O errors; on a timeout
  // naming the communicator.
  CheckpointWriter(std::string root, int64_t step, std::shared_ptr<collectives::Communicator> group,
                   CheckpointWriterOptions options = {});
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;
  ~CheckpointWriter() = default;

  // ROOT/.tmp-step-N, where the files go until commit().
  const std::string& temp_dir() const { return temp_dir_; }
  // ROOT/step-N, where they are after commit().
  const std::string& final_dir() const { return final_dir_; }
  // temp_dir()/name, created when missing (any rank may call it, not
  // collective). `name` is a plain relative path ("model", "optim").
  std::string subdir(const std::string& name) const;
  // Notes files this rank wrote with their size and CRC32, so commit() does
  // not read them again. Files not recorded (a JSON the caller wrote) are
  // read, fsynced and checksummed by rank 0 at commit().
  void record(const std::vector<WrittenFile>& files);
  void record(const SaveResult& saved) { record(saved.files); }

  // commit()
  //
  // Collective over the group. Each rank hands its records to rank 0
  // (through a small file in the temporary directory); after a barrier,
  // rank 0 lists every file of the temporary directory, writes the manifest
  // (with `extra_json`, a JSON object given as text, under "extra"), fsyncs,
  // renames the directory to final_dir() (replacing an older ROOT/step-N)
  // and fsyncs ROOT; then every rank learns whether that succeeded.
  // Returns final_dir().
  // Throws: c10::Error when `extra_json` is not a JSON object, on I/O errors
  // (naming the file), when rank 0 failed (on the other ranks), or when a
  // rank does not arrive within the timeout.
  std::string commit(const std::string& extra_json = "{}");
  bool committed() const { return committed_; }

 private:
  std::string root_;
  int64_t step_;
  std::shared_ptr<collectives::Communicator> group_;
  CheckpointWriterOptions options_;
  std::string temp_dir_;
  std::string final_dir_;
  std::vector<WrittenFile> records_;
  bool committed_ = false;
};

// What a manifest says.
struct CheckpointManifest {
  std::string dir;
  int64_t step = 0;
  int64_t world_size = 0;
  std::string mesh;
  std::vector<WrittenFile> files;  // path relative to dir
  std::string extra_json;          // the caller's JSON object, as text
};

// Reads and checks dir/manifest.json: its fields, and that every file path
// is a relative path of plain names (no "..", no absolute path, no empty
// part), refused before any of them is opened.
// Throws: c10::Error naming the directory when the manifest is missing (an
// unfinished checkpoint), or naming the manifest and the field otherwise.
CheckpointManifest read_manifest(const std::string& dir);

// read_manifest(), then checks each listed file's size and CRC32.
// Throws: c10::Error naming the file, the expected and the actual value.
CheckpointManifest verify_checkpoint(const std::string& dir);

struct CheckpointRef {
  std::string path;  // ROOT/step-N
  int64_t step = 0;
};

// The complete checkpoints in `root` (directories step-N holding a
// manifest.json), oldest first. Temporary directories (.tmp-step-N) and
// directories without a manifest are skipped. An absent root has none.
std::vector<CheckpointRef> list_checkpoints(const std::string& root);
// The newest of them, or nullopt when there is none (a first run).
std::optional<CheckpointRef> find_latest_checkpoint(const std::string& root);

// Keeps the newest `keep` complete checkpoints of `root` and removes the
// older ones, plus every temporary directory (.tmp-step-N, .old-step-N: saves
// that did not finish). Call on one rank only (rank 0), when no save is in
// progress (after commit() returned). Returns the removed paths.
// REQUIRES: keep >= 1.
std::vector<std::string> prune_checkpoints(const std::string& root, int64_t keep);

}  // namespace fsdp::checkpoint
