// NOTE [restricted unpickling], in one process: what the writer writes the
// reader reads back; Python's torch.load reads the writer's files; what a
// pickle may not do (name a global outside the list, run out of bytes,
// reach past its storage, hold itself) is refused by name.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <ATen/ATen.h>

#include "zero/core/error.h"
#include "zero/snapshots/checkpoint_format.h"
#include "zero/snapshots/pickle.h"

namespace {

namespace pk = zero::ckpt::pickle;
using pk::Value;

const std::string kWork = std::string(ZERO_BINARY_DIR) + "/tests/pickle_" + std::to_string(getpid()) + "/";

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const zero::Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Pickle, WhatIsWrittenReadsBack) {
  auto root = Value::dict();
  root->set("none", Value::none());
  root->set("yes", Value::boolean(true));
  root->set("small", Value::integer(7));
  root->set("negative", Value::integer(-3));
  root->set("large", Value::integer(int64_t{1} << 40));
  root->set("most_negative", Value::integer(-(int64_t{1} << 62)));
  root->set("pi", Value::real(3.141592653589793));
  root->set("text", Value::str("héllo"));
  root->set("shape", Value::size({4, 5}));
  root->set("pair", Value::tuple({Value::integer(1), Value::str("b")}));
  auto ordered = Value::dict(true);
  ordered->set("z", Value::integer(1));
  ordered->set("a", Value::integer(2));
  root->set("ordered", ordered);
  root->set(int64_t{5}, Value::list({Value::integer(1), Value::integer(2)}));
  auto state = Value::dict();
  state->set("cur_scale", Value::real(1.0));
  root->set("scaler", Value::object("deepspeed.runtime.fp16.loss_scaler.LossScaler", state));
  std::vector<at::Tensor> tensors;
  root->set("t", Value::tensor_of(at::arange(6, at::kFloat).view({2, 3})));
  const std::string bytes = pk::serialize(*root, &tensors);
  ASSERT_EQ(tensors.size(), 1u);
  const auto back = pk::parse(bytes, "test");
  EXPECT_EQ(back->at("small", "t").as_int("t"), 7);
  EXPECT_EQ(back->at("negative", "t").as_int("t"), -3);
  EXPECT_EQ(back->at("large", "t").as_int("t"), int64_t{1} << 40);
  EXPECT_EQ(back->at("most_negative", "t").as_int("t"), -(int64_t{1} << 62));
  EXPECT_EQ(back->at("pi", "t").as_double("t"), 3.141592653589793);
  EXPECT_EQ(back->at("text", "t").as_str("t"), "héllo");
  EXPECT_TRUE(back->at("none", "t").is_none());
  EXPECT_TRUE(back->at("yes", "t").as_bool("t"));
  EXPECT_EQ(back->at("shape", "t").kind, Value::Kind::kSize);
  EXPECT_EQ(back->at("shape", "t").as_sequence("t").size(), 2u);
  const auto& od = back->at("ordered", "t");
  EXPECT_TRUE(od.ordered);
  EXPECT_EQ(od.as_dict("t")[0].first->s, "z");
  ASSERT_NE(back->find(int64_t{5}), nullptr);
  EXPECT_EQ(back->find(int64_t{5})->as_sequence("t").size(), 2u);
  EXPECT_EQ(back->at("scaler", "t").kind, Value::Kind::kObject);
  EXPECT_EQ(back->at("scaler", "t").at("cur_scale", "t").as_double("t"), 1.0);
  const auto& t = back->at("t", "t").as_tensor("t");
  EXPECT_EQ(t.record, "data/0");
  EXPECT_EQ(t.sizes, (std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(t.contiguous());
  // Errors name where: a missing key, a wrong kind.
  EXPECT_NE(error_of([&] { back->at("absent", "FILE: x"); }).find("FILE: x: has no absent"), std::string::npos);
  EXPECT_NE(error_of([&] { back->at("text", "F").as_int("F: text"); }).find("F: text: expected an int, got a str"),
            std::string::npos);
}

TEST(Pickle, ArchivesRoundTripAndPythonReadsThem) {
  zero::ckpt::make_folders(kWork);
  auto root = Value::dict();
  root->set("w", Value::tensor_of(at::linspace(0, 1, 12, at::kFloat).view({3, 4})));
  root->set("b", Value::tensor_of(at::ones({5}, at::kBFloat16)));
  root->set("shape", Value::size({3, 4}));
  const std::string path = kWork + "x.pt";
  pk::save(path, *root);
  auto a = pk::Archive::open(path);
  const at::Tensor w = a->read(a->root().at("w", path).as_tensor(path));
  EXPECT_TRUE(w.equal(at::linspace(0, 1, 12, at::kFloat).view({3, 4})));
  std::vector<float> part(5);
  a->read_floats(a->root().at("w", path).as_tensor(path), 3, 5, part.data());
  EXPECT_FLOAT_EQ(part[0], w.reshape({-1})[3].item<float>());
  std::vector<float> b(5);
  a->read_floats(a->root().at("b", path).as_tensor(path), 0, 5, b.data());
  EXPECT_EQ(b[4], 1.0f);
  EXPECT_NE(error_of([&] { a->read_floats(a->root().at("w", path).as_tensor(path), 10, 5, part.data()); })
                .find("a tensor of 12"),
            std::string::npos);
  // torch.load, weights_only, reads it: plain types, tensors, torch.Size.
  const std::string py = "python3 -c \"import torch; d = torch.load('" + path + "', weights_only=True); "
                         "assert d['w'].shape == (3, 4) and d['b'].dtype == torch.bfloat16 and d['shape'] == torch.Size([3, 4]); "
                         "assert torch.equal(d['w'], torch.linspace(0, 1, 12).view(3, 4)); print('ok')\" > " + kWork + "py.log 2>&1";
  EXPECT_EQ(std::system(py.c_str()), 0) << std::ifstream(kWork + "py.log").rdbuf();
  zero::ckpt::remove_tree(kWork);
}

TEST(Pickle, ForeignGlobalsAreRefusedByName) {
  // cposix\nsystem\n ( X"echo" t R .   -- os.system('echo') as pickle protocol 2 writes it
  const std::string evil = std::string("\x80\x02") + "cposix\nsystem\n(X\x04\x00\x00\x00" + "echot" + "R.";
  const std::string e = error_of([&] { pk::parse(evil, "evil.pt"); });
  EXPECT_NE(e.find("evil.pt: byte 2 of its pickle: names the global posix.system, which is not one zero reads"),
            std::string::npos)
      << e;
  // Also through STACK_GLOBAL (protocol 4) and as a class to build.
  const std::string stack = std::string("\x80\x04") + "\x8c\x08" + "builtins" + "\x8c\x04" + "eval" + "\x93" + ")R.";
  EXPECT_NE(error_of([&] { pk::parse(stack, "s.pt"); }).find("names the global builtins.eval"), std::string::npos);
  const std::string obj = std::string("\x80\x02") + "ccollections\nCounter\n)\x81.";
  EXPECT_NE(error_of([&] { pk::parse(obj, "o.pt"); }).find("names the global collections.Counter"), std::string::npos);
}

TEST(Pickle, MalformedPicklesAreRefused) {
  EXPECT_NE(error_of([&] { pk::parse(std::string("\x80\x02}X\x10\x00\x00\x00" "ab", 10), "t.pt"); }).find("truncated"),
            std::string::npos);
  EXPECT_NE(error_of([&] { pk::parse(std::string("\x80\x02}", 3), "t.pt"); }).find("truncated (no STOP)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { pk::parse(std::string("\x80\x02h\x05.", 5), "t.pt"); }).find("memo entry 5"),
            std::string::npos);
  EXPECT_NE(error_of([&] { pk::parse(std::string("\x80\x02" "a.", 4), "t.pt"); }).find("empty stack"),
            std::string::npos);
  EXPECT_NE(error_of([&] { pk::parse(std::string("\x80\x02i", 3), "t.pt"); }).find("opcode 0x69"), std::string::npos);
  // A list that holds itself; values nested deeper than any checkpoint's.
  EXPECT_NE(error_of([&] { pk::parse(std::string("\x80\x02]q\x00h\x00" "a.", 9), "t.pt"); }).find("inside itself"),
            std::string::npos);
  const std::string deep = std::string("\x80\x02") + std::string(200, '(') + std::string(200, 't') + ".";
  EXPECT_NE(error_of([&] { pk::parse(deep, "t.pt"); }).find("nests values more than 100 deep"), std::string::npos);
  // A list built of a memoized list many times over (2^40 paths): parsed and walked at once.
  std::string wide = std::string("\x80\x02]q\x00", 5) + "0";  // [] memo 0, popped
  for (int k = 1; k <= 40; ++k)                                  // [m[k-1], m[k-1]] memo k, popped
    wide += "(h" + std::string(1, static_cast<char>(k - 1)) + "h" + std::string(1, static_cast<char>(k - 1)) + "lq" +
            std::string(1, static_cast<char>(k)) + "0";
  wide += "h" + std::string(1, static_cast<char>(40)) + ".";
  EXPECT_NO_THROW(pk::parse(wide, "t.pt"));
  // A tensor reaching past its storage.
  auto root = Value::tensor_of(at::zeros({4}));
  std::vector<at::Tensor> tensors;
  std::string bytes = pk::serialize(*root, &tensors);
  const std::string four = std::string("K\x04", 2);  // the size tuple's 4 -> 9 (the numel before it stays 4)
  const size_t at = bytes.rfind(four);
  ASSERT_NE(at, std::string::npos);
  bytes[at + 1] = 9;
  EXPECT_NE(error_of([&] { pk::parse(bytes, "t.pt"); }).find("reaching element 8 of a storage of 4"), std::string::npos);
}

TEST(Pickle, ArchivesThatAreNotTorchSaveFilesAreNamed) {
  zero::ckpt::make_folders(kWork);
  const std::string path = kWork + "not_a_zip.pt";
  std::ofstream(path) << "this is not a zip archive";
  EXPECT_NE(error_of([&] { pk::Archive::open(path); }).find(path + ": not a torch.save zip archive"), std::string::npos);
  EXPECT_NE(error_of([&] { pk::Archive::open(kWork + "absent.pt"); }).find("absent.pt: no such file"), std::string::npos);
  // Truncated: the zip's directory is at its end.
  auto root = Value::dict();
  root->set("w", Value::tensor_of(at::ones({1000})));
  pk::save(kWork + "whole.pt", *root);
  const int64_t size = zero::ckpt::file_size(kWork + "whole.pt");
  ASSERT_EQ(truncate((kWork + "whole.pt").c_str(), size / 2), 0);
  EXPECT_NE(error_of([&] { pk::Archive::open(kWork + "whole.pt"); }).find("whole.pt: not a torch.save zip archive"),
            std::string::npos);
  zero::ckpt::remove_tree(kWork);
}

}  // namespace
