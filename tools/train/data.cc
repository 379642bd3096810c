#include "data.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <utility>

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "fsdp_data/distributed_sampler.h"

#ifndef FSDP_TRAIN_DEFAULT_DATA
#define FSDP_TRAIN_DEFAULT_DATA ""
#endif

namespace fsdp_train {

namespace {

bool read_file(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return false;
  *out = ss.str();
  return true;
}

at::Tensor to_bytes(const std::string& text) {
  at::Tensor t = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
  if (!text.empty()) std::memcpy(t.data_ptr<uint8_t>(), text.data(), text.size());
  return t;
}

}  // namespace

std::string default_corpus_path() { return FSDP_TRAIN_DEFAULT_DATA; }

std::string generated_text(int64_t bytes) {
  // A tiny grammar over a fixed vocabulary, driven by a fixed-seed generator:
  // enough structure (words, spaces, punctuation, capitals) for loss to fall.
  static const char* const kSubjects[] = {"the keeper", "a small boat", "the old mill", "my sister", "the river",
                                          "every lamp", "the orchard",  "a grey heron", "the tide",  "our neighbour"};
  static const char* const kVerbs[] = {"watched", "carried", "forgot", "mended",   "followed",
                                       "painted", "counted", "lifted", "answered", "gathered"};
  static const char* const kObjects[] = {"the morning light", "a basket of pears", "the long road",
                                         "the bell",          "the quiet harbour", "a letter",
                                         "the winter wind",   "the last candle"};
  static const char* const kEndings[] = {".", ".", ".", "!", "?", ", and then the day went on."};
  std::mt19937_64 gen(20240601);
  auto pick = [&gen](const auto& list) { return list[gen() % (sizeof(list) / sizeof(list[0]))]; };
  std::string text;
  while (static_cast<int64_t>(text.size()) < bytes) {
    std::string sentence = absl::StrCat(pick(kSubjects), " ", pick(kVerbs), " ", pick(kObjects), pick(kEndings));
    sentence[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(sentence[0])));
    text += sentence;
    text += gen() % 6 == 0 ? "\n\n" : " ";
  }
  text.resize(bytes);
  return text;
}

absl::StatusOr<Corpus> load_corpus(const std::string& path, int64_t min_bytes) {
  Corpus corpus;
  std::string text;
  if (path.empty()) {
    const std::string builtin = default_corpus_path();
    if (!builtin.empty() && read_file(builtin, &text)) {
      corpus.source = builtin;
    } else {
      text = generated_text(std::max<int64_t>(40000, 4 * min_bytes));
      corpus.source = "generated text (default corpus '" + builtin + "' not found)";
    }
  } else {
    if (!read_file(path, &text)) {
      return absl::NotFoundError(absl::StrCat("--data: cannot read '", path, "': ", std::strerror(errno)));
    }
    corpus.source = path;
  }
  if (static_cast<int64_t>(text.size()) < min_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("--data: '", corpus.source, "' has ", text.size(),
                                                   " bytes, fewer than the ", min_bytes,
                                                   " that --seq-len needs; use a longer text or a shorter --seq-len"));
  }
  corpus.bytes = to_bytes(text);
  return corpus;
}

BatchSampler::BatchSampler(at::Tensor bytes, int64_t global_batch, int64_t seq_len, int64_t seed)
    : bytes_(std::move(bytes)), global_batch_(global_batch), seq_len_(seq_len), seed_(seed) {
  TORCH_CHECK(bytes_.dim() == 1 && bytes_.numel() > seq_len_ + 1, "BatchSampler: the corpus (", bytes_.numel(),
              " bytes) must be longer than seq_len + 1 = ", seq_len_ + 1);
}

std::vector<int64_t> BatchSampler::offsets(int64_t step) const {
  // Seeded from (seed, step) together: batch `step` is the same in every run
  // with this seed, whatever the world size, and batches of different seeds
  // do not repeat one another shifted by a step.
  const auto s = static_cast<uint64_t>(seed_), k = static_cast<uint64_t>(step);
  std::seed_seq seq{static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32), static_cast<uint32_t>(k),
                    static_cast<uint32_t>(k >> 32)};
  std::mt19937_64 gen(seq);
  const auto range = static_cast<uint64_t>(bytes_.numel() - seq_len_);  // offsets 0 .. numel - seq_len - 1
  std::vector<int64_t> out(global_batch_);
  for (auto& o : out) o = static_cast<int64_t>(gen() % range);
  return out;
}

Batch BatchSampler::local_batch(int64_t step, int64_t index, int64_t parts) const {
  // Throws, naming the batch size and the ranks, when a part would get no row
  // or the parts would be unequal.
  const fsdp::data::BatchSlice slice = fsdp::data::split_global_batch(global_batch_, parts, index);
  const int64_t rows = slice.rows;
  std::vector<int64_t> all = offsets(step);
  std::vector<int64_t> mine(all.begin() + slice.begin, all.begin() + slice.begin + rows);
  const at::Tensor starts = at::tensor(mine, at::kLong).unsqueeze(1);                      // [rows, 1]
  const at::Tensor positions = starts + at::arange(seq_len_ + 1, at::kLong).unsqueeze(0);  // [rows, seq+1]
  const at::Tensor window = bytes_.index_select(0, positions.reshape({-1})).view({rows, seq_len_ + 1}).to(at::kLong);
  return {window.narrow(1, 0, seq_len_).contiguous(), window.narrow(1, 1, seq_len_).contiguous()};
}

}  // namespace fsdp_train
