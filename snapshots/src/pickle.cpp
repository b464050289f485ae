// NOTE [restricted unpickling] (pickle.h).
#include "zero/snapshots/pickle.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>

#include "zero/core/error.h"
#include "zero/snapshots/checkpoint_format.h"

namespace zero::ckpt::pickle {

int64_t TensorRef::numel() const {
  int64_t n = 1;
  for (int64_t d : sizes) n *= d;
  return n;
}

bool TensorRef::contiguous() const {
  int64_t expected = 1;
  for (size_t k = sizes.size(); k-- > 0;) {
    if (sizes[k] != 1 && strides[k] != expected) return false;
    expected *= sizes[k];
  }
  return true;
}

std::string Value::kind_name() const {
  switch (kind) {
    case Kind::kNone: return "None";
    case Kind::kBool: return "a bool";
    case Kind::kInt: return "an int";
    case Kind::kFloat: return "a float";
    case Kind::kStr: return "a str";
    case Kind::kBytes: return "bytes";
    case Kind::kTuple: return "a tuple";
    case Kind::kList: return "a list";
    case Kind::kDict: return "a dict";
    case Kind::kSize: return "a torch.Size";
    case Kind::kTensor: return "a tensor";
    case Kind::kObject: return "an object of " + s;
    case Kind::kGlobal: return s;
    case Kind::kStorage: return "a storage";
  }
  return "?";
}

const Value* Value::find(const std::string& key) const {
  if (kind != Kind::kDict && kind != Kind::kObject) return nullptr;
  for (const auto& [k, v] : entries)
    if (k->kind == Kind::kStr && k->s == key) return v.get();
  return nullptr;
}

const Value* Value::find(int64_t key) const {
  if (kind != Kind::kDict) return nullptr;
  for (const auto& [k, v] : entries)
    if (k->kind == Kind::kInt && k->i == key) return v.get();
  return nullptr;
}

const Value& Value::at(const std::string& key, const std::string& where) const {
  if (kind != Kind::kDict && kind != Kind::kObject)
    throw IoError(where + ": expected a dict holding " + key + ", got " + kind_name());
  const Value* v = find(key);
  if (v == nullptr) throw IoError(where + ": has no " + key);
  return *v;
}

namespace {
[[noreturn]] void wrong_kind(const Value& v, const std::string& want, const std::string& where) {
  throw IoError(where + ": expected " + want + ", got " + v.kind_name());
}
}  // namespace

int64_t Value::as_int(const std::string& where) const {
  if (kind == Kind::kInt) return i;
  if (kind == Kind::kBool) return b ? 1 : 0;
  wrong_kind(*this, "an int", where);
}

double Value::as_double(const std::string& where) const {
  if (kind == Kind::kFloat) return f;
  if (kind == Kind::kInt) return static_cast<double>(i);
  wrong_kind(*this, "a number", where);
}

bool Value::as_bool(const std::string& where) const {
  if (kind == Kind::kBool) return b;
  wrong_kind(*this, "a bool", where);
}

const std::string& Value::as_str(const std::string& where) const {
  if (kind == Kind::kStr) return s;
  wrong_kind(*this, "a str", where);
}

const TensorRef& Value::as_tensor(const std::string& where) const {
  if (kind == Kind::kTensor) return tensor;
  wrong_kind(*this, "a tensor", where);
}

const std::vector<ValuePtr>& Value::as_sequence(const std::string& where) const {
  if (kind == Kind::kTuple || kind == Kind::kList || kind == Kind::kSize) return items;
  wrong_kind(*this, "a list or tuple", where);
}

const std::vector<std::pair<ValuePtr, ValuePtr>>& Value::as_dict(const std::string& where) const {
  if (kind == Kind::kDict || kind == Kind::kObject) return entries;
  wrong_kind(*this, "a dict", where);
}

namespace {
ValuePtr make(Value::Kind kind) {
  auto v = std::make_shared<Value>();
  v->kind = kind;
  return v;
}
}  // namespace

ValuePtr Value::none() { return make(Kind::kNone); }
ValuePtr Value::boolean(bool x) {
  auto v = make(Kind::kBool);
  v->b = x;
  return v;
}
ValuePtr Value::integer(int64_t x) {
  auto v = make(Kind::kInt);
  v->i = x;
  return v;
}
ValuePtr Value::real(double x) {
  auto v = make(Kind::kFloat);
  v->f = x;
  return v;
}
ValuePtr Value::str(std::string x) {
  auto v = make(Kind::kStr);
  v->s = std::move(x);
  return v;
}
ValuePtr Value::list(std::vector<ValuePtr> items) {
  auto v = make(Kind::kList);
  v->items = std::move(items);
  return v;
}
ValuePtr Value::tuple(std::vector<ValuePtr> items) {
  auto v = make(Kind::kTuple);
  v->items = std::move(items);
  return v;
}
ValuePtr Value::size(const std::vector<int64_t>& dims) {
  auto v = make(Kind::kSize);
  for (int64_t d : dims) v->items.push_back(integer(d));
  return v;
}
ValuePtr Value::dict(bool ordered) {
  auto v = make(Kind::kDict);
  v->ordered = ordered;
  return v;
}
ValuePtr Value::tensor_of(at::Tensor t) {
  auto v = make(Kind::kTensor);
  v->data = std::move(t);
  return v;
}
ValuePtr Value::object(std::string qualified_name, ValuePtr state) {
  auto v = make(Kind::kObject);
  v->s = std::move(qualified_name);
  v->entries = state->entries;
  return v;
}
Value& Value::set(const std::string& key, ValuePtr v) {
  for (auto& [k, old] : entries)
    if (k->kind == Kind::kStr && k->s == key) {
      old = std::move(v);
      return *this;
    }
  entries.emplace_back(str(key), std::move(v));
  return *this;
}
Value& Value::set(int64_t key, ValuePtr v) {
  for (auto& [k, old] : entries)
    if (k->kind == Kind::kInt && k->i == key) {
      old = std::move(v);
      return *this;
    }
  entries.emplace_back(integer(key), std::move(v));
  return *this;
}

// ---------------------------------------------------------------- reading

namespace {

// torch's storage classes and the dtypes they hold.
const std::map<std::string, at::ScalarType>& storage_types() {
  static const std::map<std::string, at::ScalarType> m{
      {"FloatStorage", at::kFloat},   {"DoubleStorage", at::kDouble}, {"HalfStorage", at::kHalf},
      {"BFloat16Storage", at::kBFloat16}, {"LongStorage", at::kLong},  {"IntStorage", at::kInt},
      {"ShortStorage", at::kShort},   {"CharStorage", at::kChar},     {"ByteStorage", at::kByte},
      {"BoolStorage", at::kBool},     {"UntypedStorage", at::kByte}};
  return m;
}

// The dtypes torch.save writes as globals (torch.float32, ...).
bool is_dtype_name(const std::string& n) {
  static const char* names[] = {"float32", "float", "float64", "double", "float16", "half", "bfloat16", "int64",
                                "long",    "int32", "int",     "int16",  "short",   "int8", "uint8",    "bool"};
  for (const char* x : names)
    if (n == x) return true;
  return false;
}

// The classes a DeepSpeed checkpoint pickles, kept as objects (their state a dict).
bool is_known_class(const std::string& q) {
  return q == "deepspeed.runtime.fp16.loss_scaler.LossScaler" ||
         q == "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler" ||
         q == "deepspeed.utils.tensor_fragment.fragment_address" || q == "argparse.Namespace";
}

const char* kKnownGlobals =
    "collections.OrderedDict, set, torch._utils._rebuild_tensor_v2, torch._utils._rebuild_parameter, "
    "torch._tensor._rebuild_from_type_v2, torch.Tensor, torch.nn.parameter.Parameter, torch.Size, "
    "torch.<Type>Storage, torch.<dtype>, torch.device, _codecs.encode, "
    "deepspeed.runtime.zero.config.ZeroStageEnum, deepspeed.runtime.fp16.loss_scaler.LossScaler and "
    "DynamicLossScaler, deepspeed.utils.tensor_fragment.fragment_address, argparse.Namespace";

class Machine {
 public:
  Machine(const std::string& bytes, const std::string& where) : in_(bytes), where_(where) {}

  ValuePtr run() {
    while (true) {
      const size_t at = pos_;
      const uint8_t op = byte();
      switch (op) {
        case 0x80: byte(); break;                 // PROTO
        case 0x95: take(8); break;                // FRAME
        case '.':                                 // STOP
          if (stack_.size() != 1 || !marks_.empty()) fail(at, "STOP with " + std::to_string(stack_.size()) + " values on the stack");
          return stack_.back();
        case '(': marks_.push_back(stack_.size()); break;  // MARK
        case '0': pop(at); break;                          // POP
        case '1': pop_mark(at); break;                     // POP_MARK
        case '2': push(top(at)); break;                    // DUP
        case 'N': push(Value::none()); break;
        case 0x88: push(Value::boolean(true)); break;
        case 0x89: push(Value::boolean(false)); break;
        case 'J': push(Value::integer(static_cast<int32_t>(le(4)))); break;  // BININT
        case 'K': push(Value::integer(static_cast<int64_t>(le(1)))); break;  // BININT1
        case 'M': push(Value::integer(static_cast<int64_t>(le(2)))); break;  // BININT2
        case 0x8a: push(Value::integer(long_bytes(at, le(1)))); break;      // LONG1
        case 0x8b: push(Value::integer(long_bytes(at, le(4)))); break;      // LONG4
        case 'I': {                                                           // INT (text)
          const std::string line = read_line(at);
          if (line == "01" || line == "00") push(Value::boolean(line == "01"));
          else push(Value::integer(parse_int(at, line)));
          break;
        }
        case 'L': push(Value::integer(parse_int(at, strip_l(read_line(at))))); break;  // LONG (text)
        case 'G': {                                                                     // BINFLOAT, big-endian
          uint64_t bits = 0;
          for (char c : take(8)) bits = (bits << 8) | static_cast<uint8_t>(c);
          double d;
          std::memcpy(&d, &bits, 8);
          push(Value::real(d));
          break;
        }
        case 'X': push(Value::str(take(le(4)))); break;     // BINUNICODE
        case 0x8c: push(Value::str(take(le(1)))); break;    // SHORT_BINUNICODE
        case 0x8d: push(Value::str(take(le(8)))); break;    // BINUNICODE8
        case 'T': push(Value::str(take(le(4)))); break;     // BINSTRING
        case 'U': push(Value::str(take(le(1)))); break;     // SHORT_BINSTRING
        case 'B': push(bytes_value(take(le(4)))); break;    // BINBYTES
        case 'C': push(bytes_value(take(le(1)))); break;    // SHORT_BINBYTES
        case 0x8e: push(bytes_value(take(le(8)))); break;   // BINBYTES8
        case ')': push(Value::tuple({})); break;            // EMPTY_TUPLE
        case 't': push(Value::tuple(pop_mark(at))); break;  // TUPLE
        case 0x85: case 0x86: case 0x87: {                  // TUPLE1..3
          const size_t n = op - 0x84;
          if (depth() < n) fail(at, "TUPLE" + std::to_string(n) + " with too few values");
          std::vector<ValuePtr> items(stack_.end() - static_cast<std::ptrdiff_t>(n), stack_.end());
          stack_.resize(stack_.size() - n);
          push(Value::tuple(std::move(items)));
          break;
        }
        case ']': push(Value::list()); break;                   // EMPTY_LIST
        case 'l': push(Value::list(pop_mark(at))); break;       // LIST
        case 'a': {                                             // APPEND
          ValuePtr v = pop(at);
          list_of(at).items.push_back(std::move(v));
          break;
        }
        case 'e': {  // APPENDS
          auto items = pop_mark(at);
          auto& l = list_of(at).items;
          l.insert(l.end(), items.begin(), items.end());
          break;
        }
        case '}': push(Value::dict()); break;  // EMPTY_DICT
        case 'd': {                            // DICT
          auto items = pop_mark(at);
          auto d = Value::dict();
          set_items(at, *d, items);
          push(d);
          break;
        }
        case 's': {  // SETITEM
          ValuePtr v = pop(at), k = pop(at);
          set_items(at, dict_of(at), {k, v});
          break;
        }
        case 'u': {  // SETITEMS
          auto items = pop_mark(at);
          set_items(at, dict_of(at), items);
          break;
        }
        case 0x8f: push(Value::list()); break;  // EMPTY_SET, kept as a list
        case 0x90: {                            // ADDITEMS
          auto items = pop_mark(at);
          auto& l = list_of(at).items;
          l.insert(l.end(), items.begin(), items.end());
          break;
        }
        case 0x91: push(Value::list(pop_mark(at))); break;  // FROZENSET
        case 'c': {                                         // GLOBAL
          std::string module = read_line(at), name = read_line(at);
          push(global(at, module, name));
          break;
        }
        case 0x93: {  // STACK_GLOBAL
          ValuePtr name = pop(at), module = pop(at);
          if (module->kind != Value::Kind::kStr || name->kind != Value::Kind::kStr) fail(at, "STACK_GLOBAL without names");
          push(global(at, module->s, name->s));
          break;
        }
        case 'R': {  // REDUCE
          ValuePtr args = pop(at), callable = pop(at);
          push(reduce(at, *callable, *args));
          break;
        }
        case 0x81: {  // NEWOBJ
          ValuePtr args = pop(at), cls = pop(at);
          push(new_object(at, *cls));
          break;
        }
        case 0x92: {  // NEWOBJ_EX
          pop(at);
          pop(at);
          ValuePtr cls = pop(at);
          push(new_object(at, *cls));
          break;
        }
        case 'b': {  // BUILD
          ValuePtr state = pop(at);
          build(at, *top(at), state);
          break;
        }
        case 'q': memo_[le(1)] = top(at); break;     // BINPUT
        case 'r': memo_[le(4)] = top(at); break;     // LONG_BINPUT
        case 'p': memo_[parse_int(at, read_line(at))] = top(at); break;  // PUT
        case 0x94: memo_[memo_.size()] = top(at); break;                   // MEMOIZE
        case 'h': push(memo(at, le(1))); break;                            // BINGET
        case 'j': push(memo(at, le(4))); break;                            // LONG_BINGET
        case 'g': push(memo(at, parse_int(at, read_line(at)))); break;     // GET
        case 'Q': {                                                        // BINPERSID
          ValuePtr pid = pop(at);
          push(storage(at, *pid));
          break;
        }
        default: {
          char hex[8];
          std::snprintf(hex, sizeof hex, "0x%02x", op);
          fail(at, std::string("pickle opcode ") + hex + " is not one torch.save writes");
        }
      }
    }
  }

 private:
  [[noreturn]] void fail(size_t at, const std::string& what) const {
    throw IoError(where_ + ": byte " + std::to_string(at) + " of its pickle: " + what);
  }
  uint8_t byte() {
    if (pos_ >= in_.size()) fail(pos_, "truncated (no STOP)");
    return static_cast<uint8_t>(in_[pos_++]);
  }
  std::string take(uint64_t n) {
    if (n > in_.size() - pos_) fail(pos_, "truncated: " + std::to_string(n) + " bytes announced, " +
                                              std::to_string(in_.size() - pos_) + " left");
    std::string out = in_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  uint64_t le(int n) {
    const std::string b = take(static_cast<uint64_t>(n));
    uint64_t v = 0;
    for (int k = n - 1; k >= 0; --k) v = (v << 8) | static_cast<uint8_t>(b[static_cast<size_t>(k)]);
    return v;
  }
  int64_t long_bytes(size_t at, uint64_t n) {
    if (n > 8) fail(at, "an integer of " + std::to_string(n) + " bytes (more than 64 bits)");
    const std::string b = take(n);
    uint64_t v = 0;
    for (size_t k = n; k-- > 0;) v = (v << 8) | static_cast<uint8_t>(b[k]);
    if (n > 0 && n < 8 && (static_cast<uint8_t>(b[n - 1]) & 0x80)) v |= ~uint64_t{0} << (8 * n);  // sign
    return static_cast<int64_t>(v);
  }
  std::string read_line(size_t at) {
    const size_t nl = in_.find('\n', pos_);
    if (nl == std::string::npos) fail(at, "truncated text argument");
    std::string out = in_.substr(pos_, nl - pos_);
    pos_ = nl + 1;
    return out;
  }
  static std::string strip_l(std::string s) {
    if (!s.empty() && s.back() == 'L') s.pop_back();
    return s;
  }
  int64_t parse_int(size_t at, const std::string& s) const {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (s.empty() || *end != '\0' || errno != 0) fail(at, "not an integer: " + s);
    return v;
  }
  static ValuePtr bytes_value(std::string b) {
    auto v = Value::str(std::move(b));
    v->kind = Value::Kind::kBytes;
    return v;
  }
  void push(ValuePtr v) { stack_.push_back(std::move(v)); }
  size_t depth() const { return stack_.size() - (marks_.empty() ? 0 : marks_.back()); }
  ValuePtr pop(size_t at) {
    if (depth() == 0) fail(at, "a value taken from an empty stack");
    ValuePtr v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  const ValuePtr& top(size_t at) const {
    if (depth() == 0) fail(at, "a value read from an empty stack");
    return stack_.back();
  }
  std::vector<ValuePtr> pop_mark(size_t at) {
    if (marks_.empty()) fail(at, "no MARK");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<ValuePtr> items(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  Value& list_of(size_t at) {
    const ValuePtr& l = top(at);
    if (l->kind != Value::Kind::kList) fail(at, "items appended to " + l->kind_name());
    return *l;
  }
  Value& dict_of(size_t at) {
    const ValuePtr& d = top(at);
    if (d->kind != Value::Kind::kDict) fail(at, "items set in " + d->kind_name());
    return *d;
  }
  // (A dict's keys are unique in what Python writes; a repeated key is kept
  // twice and find() sees the first: appending keeps a large dict linear.)
  void set_items(size_t at, Value& d, const std::vector<ValuePtr>& items) {
    if (items.size() % 2 != 0) fail(at, "a dict's items without a value for the last key");
    for (size_t k = 0; k < items.size(); k += 2) d.entries.emplace_back(items[k], items[k + 1]);
  }
  ValuePtr memo(size_t at, uint64_t key) const {
    auto it = memo_.find(key);
    if (it == memo_.end()) fail(at, "memo entry " + std::to_string(key) + " read before it was written");
    return it->second;
  }
  ValuePtr global(size_t at, const std::string& module, const std::string& name) const {
    const std::string q = module + "." + name;
    const bool known = q == "collections.OrderedDict" || q == "torch._utils._rebuild_tensor_v2" ||
                       q == "torch._tensor._rebuild_from_type_v2" || q == "torch.Tensor" ||
                       q == "torch.nn.parameter.Parameter" || q == "__builtin__.set" || q == "builtins.set" ||
                       q == "torch._utils._rebuild_parameter" || q == "torch.Size" || q == "torch.device" ||
                       q == "_codecs.encode" || q == "deepspeed.runtime.zero.config.ZeroStageEnum" ||
                       (module == "torch" && (storage_types().count(name) != 0 || is_dtype_name(name))) ||
                       is_known_class(q);
    if (!known)
      fail(at, "names the global " + q + ", which is not one zero reads (it reads " + kKnownGlobals +
                   "); nothing it names is run: save the checkpoint without it, or convert it where Python runs");
    auto v = std::make_shared<Value>();
    v->kind = Value::Kind::kGlobal;
    v->s = q;
    if (module == "torch" && is_dtype_name(name)) {  // a dtype: its name
      v->kind = Value::Kind::kStr;
      v->s = "torch." + name;
    }
    return v;
  }
  ValuePtr storage(size_t at, const Value& pid) const {
    // ('storage', torch.<Type>Storage, key, location, numel)
    if (pid.kind != Value::Kind::kTuple || pid.items.size() != 5 || pid.items[0]->kind != Value::Kind::kStr ||
        pid.items[0]->s != "storage" || pid.items[1]->kind != Value::Kind::kGlobal ||
        pid.items[2]->kind != Value::Kind::kStr || pid.items[4]->kind != Value::Kind::kInt)
      fail(at, "a persistent id that is not torch.save's storage tuple");
    const std::string type = pid.items[1]->s.substr(pid.items[1]->s.rfind('.') + 1);
    auto it = storage_types().find(type);
    if (it == storage_types().end()) fail(at, "a storage of type " + pid.items[1]->s);
    if (pid.items[4]->i < 0 || pid.items[4]->i > (int64_t{1} << 56))
      fail(at, "a storage of " + std::to_string(pid.items[4]->i) + " elements");
    auto v = std::make_shared<Value>();
    v->kind = Value::Kind::kStorage;
    v->tensor.record = "data/" + pid.items[2]->s;
    v->tensor.dtype = it->second;
    v->tensor.storage_numel = pid.items[4]->i;
    return v;
  }
  static std::vector<int64_t> ints_of(const Value& v, bool* ok) {
    std::vector<int64_t> out;
    if (v.kind != Value::Kind::kTuple && v.kind != Value::Kind::kList && v.kind != Value::Kind::kSize) {
      *ok = false;
      return out;
    }
    for (const auto& x : v.items) {
      if (x->kind != Value::Kind::kInt) *ok = false;
      else out.push_back(x->i);
    }
    return out;
  }
  ValuePtr reduce(size_t at, const Value& callable, const Value& args) const {
    if (callable.kind != Value::Kind::kGlobal) fail(at, "REDUCE of " + callable.kind_name() + ", not a global");
    if (args.kind != Value::Kind::kTuple) fail(at, "REDUCE of " + callable.s + " without an argument tuple");
    const std::string& q = callable.s;
    const auto& a = args.items;
    if (q == "collections.OrderedDict") {
      auto d = Value::dict(true);
      if (!a.empty()) fail(at, "an OrderedDict built from arguments");
      return d;
    }
    if (q == "torch._utils._rebuild_tensor_v2") {
      if (a.size() < 4 || a[0]->kind != Value::Kind::kStorage || a[1]->kind != Value::Kind::kInt)
        fail(at, "_rebuild_tensor_v2 without (storage, offset, size, stride)");
      bool ok = true;
      TensorRef t = a[0]->tensor;
      t.offset = a[1]->i;
      t.sizes = ints_of(*a[2], &ok);
      t.strides = ints_of(*a[3], &ok);
      if (!ok || t.sizes.size() != t.strides.size()) fail(at, "_rebuild_tensor_v2 with a malformed size or stride");
      int64_t last = t.offset, numel = 1;
      constexpr int64_t kLimit = int64_t{1} << 56;  // no real tensor comes near; products of two stay in range
      if (t.offset < 0 || t.offset > kLimit) fail(at, "a tensor at storage offset " + std::to_string(t.offset));
      for (size_t k = 0; k < t.sizes.size(); ++k) {
        if (t.sizes[k] < 0 || t.strides[k] < 0 || t.sizes[k] > kLimit || t.strides[k] > kLimit)
          fail(at, "a tensor with a negative or impossible size or stride");
        if (t.sizes[k] == 0) last = t.offset - 1;
        if (__builtin_mul_overflow(numel, t.sizes[k], &numel) || numel > kLimit) fail(at, "a tensor of too many elements");
      }
      if (last >= t.offset)
        for (size_t k = 0; k < t.sizes.size(); ++k) {
          int64_t reach = 0;
          if (__builtin_mul_overflow(t.sizes[k] - 1, t.strides[k], &reach) || __builtin_add_overflow(last, reach, &last) ||
              last > kLimit)
            fail(at, "a tensor reaching past any storage");
        }
      if (t.offset < 0 || last >= t.storage_numel)
        fail(at, "a tensor reaching element " + std::to_string(last) + " of a storage of " +
                     std::to_string(t.storage_numel));
      auto v = std::make_shared<Value>();
      v->kind = Value::Kind::kTensor;
      v->tensor = std::move(t);
      return v;
    }
    if (q == "torch._tensor._rebuild_from_type_v2") {
      // (func, type, args, state): a tensor with Python attributes (DeepSpeed's ds_id); they are not kept.
      if (a.size() < 3 || a[0]->kind != Value::Kind::kGlobal || a[2]->kind != Value::Kind::kTuple)
        fail(at, "_rebuild_from_type_v2 without (function, type, arguments)");
      if (a[0]->s != "torch._utils._rebuild_tensor_v2" && a[0]->s != "torch._utils._rebuild_parameter")
        fail(at, "_rebuild_from_type_v2 of " + a[0]->s + ", not a tensor's rebuild");
      return reduce(at, *a[0], *a[2]);
    }
    if (q == "__builtin__.set" || q == "builtins.set") {  // kept as a list
      if (a.empty()) return Value::list();
      if (a.size() != 1 || a[0]->kind != Value::Kind::kList) fail(at, "a set built from other than a list");
      return Value::list(a[0]->items);
    }
    if (q == "torch._utils._rebuild_parameter") {
      if (a.empty() || a[0]->kind != Value::Kind::kTensor) fail(at, "_rebuild_parameter without a tensor");
      return a[0];
    }
    if (q == "torch.Size") {
      bool ok = a.size() == 1;
      auto v = Value::size(ok ? ints_of(*a[0], &ok) : std::vector<int64_t>{});
      if (!ok) fail(at, "a torch.Size of other than integers");
      return v;
    }
    if (q == "torch.device") {
      if (a.empty() || a[0]->kind != Value::Kind::kStr) fail(at, "a torch.device without a name");
      return Value::str(a[0]->s);
    }
    if (q == "_codecs.encode") {
      if (a.empty() || a[0]->kind != Value::Kind::kStr) fail(at, "_codecs.encode without a str");
      std::string out;  // latin-1: each code point below 256 is one byte (the str holds UTF-8)
      const std::string& s = a[0]->s;
      for (size_t k = 0; k < s.size(); ++k) {
        const auto c = static_cast<uint8_t>(s[k]);
        if (c < 0x80) out += static_cast<char>(c);
        else if ((c & 0xE0) == 0xC0 && k + 1 < s.size())
          out += static_cast<char>(((c & 0x1F) << 6) | (static_cast<uint8_t>(s[++k]) & 0x3F));
        else fail(at, "_codecs.encode of text beyond latin-1");
      }
      return bytes_value(out);
    }
    if (q == "deepspeed.runtime.zero.config.ZeroStageEnum") {
      if (a.size() != 1 || a[0]->kind != Value::Kind::kInt) fail(at, "a ZeroStageEnum without its number");
      return Value::integer(a[0]->i);
    }
    if (is_known_class(q)) return new_object(at, callable);
    fail(at, "REDUCE of " + q + ", which is not a callable zero reads");
  }
  ValuePtr new_object(size_t at, const Value& cls) const {
    if (cls.kind != Value::Kind::kGlobal || !is_known_class(cls.s))
      fail(at, "an object of " + cls.kind_name() + ", which is not a class zero reads");
    auto v = std::make_shared<Value>();
    v->kind = Value::Kind::kObject;
    v->s = cls.s;
    return v;
  }
  void build(size_t at, Value& target, const ValuePtr& state_in) {
    ValuePtr state = state_in;
    // (state, slotstate): the dict of the first; slots are not kept.
    if (state->kind == Value::Kind::kTuple && state->items.size() == 2) state = state->items[0];
    if (target.kind == Value::Kind::kTensor) return;  // a tensor's or parameter's extra state (hooks): not kept
    if (target.kind != Value::Kind::kObject && target.kind != Value::Kind::kDict)
      fail(at, "BUILD of " + target.kind_name());
    if (state->kind == Value::Kind::kNone) return;
    if (state->kind != Value::Kind::kDict) fail(at, "BUILD of " + target.kind_name() + " with " + state->kind_name());
    const auto add = state->entries;  // (the state may be the target itself)
    for (const auto& e : add) target.entries.push_back(e);
  }


 public:
  /// Everything the machine still holds (its stack and memo), for release().
  std::vector<ValuePtr> take_values() {
    std::vector<ValuePtr> out = std::move(stack_);
    for (auto& [k, v] : memo_) out.push_back(std::move(v));
    memo_.clear();
    return out;
  }

 private:
  const std::string& in_;
  const std::string& where_;
  size_t pos_ = 0;
  std::vector<ValuePtr> stack_;
  std::vector<size_t> marks_;
  std::map<uint64_t, ValuePtr> memo_;
};

}  // namespace

namespace {

constexpr size_t kMaxDepth = 100;

// The k-th value a value holds (its items, then each entry's key and value), or null.
const Value* held(const Value* v, size_t k) {
  if (k < v->items.size()) return v->items[k].get();
  k -= v->items.size();
  if (k < 2 * v->entries.size()) return (k % 2 != 0 ? v->entries[k / 2].second : v->entries[k / 2].first).get();
  return nullptr;
}

// Refuses a value that holds itself or nests more than kMaxDepth deep (a
// pickle can build either with its memo), without recursion.
void check_shape(const Value& root, const std::string& where) {
  std::unordered_map<const Value*, size_t> height;  // of each value walked
  std::unordered_set<const Value*> on_path;
  struct Frame {
    const Value* v;
    size_t next;
    size_t height;
  };
  std::vector<Frame> path{{&root, 0, 0}};
  on_path.insert(&root);
  while (!path.empty()) {
    Frame& f = path.back();
    const Value* c = held(f.v, f.next++);
    if (c == nullptr) {
      height[f.v] = f.height;
      on_path.erase(f.v);
      const size_t h = f.height + 1;
      path.pop_back();
      if (!path.empty()) path.back().height = std::max(path.back().height, h);
      continue;
    }
    if (on_path.count(c) != 0) throw IoError(where + ": its pickle holds a value inside itself");
    if (auto it = height.find(c); it != height.end()) {
      f.height = std::max(f.height, it->second + 1);
      if (path.size() + it->second > kMaxDepth)
        throw IoError(where + ": its pickle nests values more than " + std::to_string(kMaxDepth) + " deep");
      continue;
    }
    if (path.size() >= kMaxDepth)
      throw IoError(where + ": its pickle nests values more than " + std::to_string(kMaxDepth) + " deep");
    path.push_back({c, 0, 0});
    on_path.insert(c);
  }
}

// Drops values without recursion: a value whose last holder this is gives
// its own values to the work list first (a deep chain would otherwise
// unwind the stack as it is freed). Values that hold themselves stay.
void release(std::vector<ValuePtr> work) {
  while (!work.empty()) {
    ValuePtr v = std::move(work.back());
    work.pop_back();
    if (v && v.use_count() == 1) {
      for (auto& x : v->items) work.push_back(std::move(x));
      for (auto& [k, x] : v->entries) {
        work.push_back(std::move(k));
        work.push_back(std::move(x));
      }
      v->items.clear();
      v->entries.clear();
    }
  }
}

}  // namespace

ValuePtr parse(const std::string& bytes, const std::string& where) {
  Machine m(bytes, where);
  ValuePtr root;
  std::exception_ptr failed;
  try {
    root = m.run();
    check_shape(*root, where);
  } catch (...) {
    failed = std::current_exception();
  }
  release(m.take_values());
  if (failed) {
    release({std::move(root)});
    std::rethrow_exception(failed);
  }
  return root;
}

// ---------------------------------------------------------------- archives

namespace {
// Every tensor of a value tree.
// (Each value once: a pickle may hold one value in many places.)
void tensors_of(const Value& v, std::vector<const TensorRef*>& out, std::unordered_set<const Value*>& seen) {
  if (!seen.insert(&v).second) return;
  if (v.kind == Value::Kind::kTensor) out.push_back(&v.tensor);
  for (const auto& x : v.items) tensors_of(*x, out, seen);
  for (const auto& [k, x] : v.entries) tensors_of(*x, out, seen);
}
}  // namespace

std::unique_ptr<Archive> Archive::open(const std::string& path) {
  std::unique_ptr<Archive> a(new Archive());
  a->path_ = path;
  if (file_size(path) < 0) throw IoError(path + ": no such file");
  std::string pkl;
  try {
    caffe2::serialize::PyTorchStreamReader zip(path);
    if (!zip.hasRecord("data.pkl"))
      throw IoError(path + ": a zip archive without data.pkl: not a file torch.save wrote");
    auto [ptr, n] = zip.getRecord("data.pkl");
    pkl.assign(static_cast<const char*>(ptr.get()), n);
    for (const auto& name : zip.getAllRecords()) {
      if (name.rfind("data/", 0) != 0) continue;
      const int64_t offset = static_cast<int64_t>(zip.getRecordOffset(name));
      const int64_t bytes = static_cast<int64_t>(zip.getRecordSize(name));
      a->records_.emplace_back(name, std::make_pair(offset, bytes));
    }
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    throw IoError(path + ": not a torch.save zip archive (torch.save's legacy format, a truncated file, or another "
                         "kind of file): " + what.substr(0, what.find('\n')));
  }
  std::sort(a->records_.begin(), a->records_.end());
  a->root_ = parse(pkl, path);
  std::vector<const TensorRef*> refs;
  std::unordered_set<const Value*> seen;
  tensors_of(*a->root_, refs, seen);
  const int64_t size = file_size(path);
  for (const TensorRef* t : refs) {
    const auto [offset, bytes] = a->record(t->record);
    const int64_t es = static_cast<int64_t>(c10::elementSize(t->dtype));
    const int64_t need = t->storage_numel > bytes / es ? bytes + 1 : t->storage_numel * es;
    if (bytes < need || offset < 0 || bytes > size || offset > size - bytes)
      throw IoError(path + ": record " + t->record + " holds " + std::to_string(bytes) + " bytes at offset " +
                    std::to_string(offset) + " of " + std::to_string(size) + "; its storage needs " +
                    std::to_string(need) + ": a truncated or damaged file");
  }
  a->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (a->fd_ < 0) throw IoError("open " + path + ": " + std::strerror(errno));
  return a;
}

Archive::~Archive() {
  if (fd_ >= 0) ::close(fd_);
}

std::pair<int64_t, int64_t> Archive::record(const std::string& name) const {
  auto it = std::lower_bound(records_.begin(), records_.end(), name,
                             [](const auto& r, const std::string& n) { return r.first < n; });
  if (it == records_.end() || it->first != name)
    throw IoError(path_ + ": its pickle names the storage record " + name + ", which the archive lacks");
  return it->second;
}

void Archive::pread_all(void* dst, int64_t n, int64_t offset) const {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t got = ::pread(fd_, p, static_cast<size_t>(n), offset);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0)
      throw IoError("read " + path_ + " at offset " + std::to_string(offset) + ", " + std::to_string(n) + " bytes: " +
                    (got == 0 ? std::string("end of file") : std::strerror(errno)));
    p += got;
    n -= got;
    offset += got;
    bytes_read_ += got;
  }
}

at::Tensor Archive::read(const TensorRef& t) const {
  const auto [offset, bytes] = record(t.record);
  (void)bytes;
  const int64_t es = static_cast<int64_t>(c10::elementSize(t.dtype));
  if (t.contiguous()) {
    at::Tensor out = at::empty(t.sizes, at::TensorOptions().dtype(t.dtype));
    if (out.numel() > 0) pread_all(out.data_ptr(), out.numel() * es, offset + t.offset * es);
    return out;
  }
  at::Tensor storage = at::empty({t.storage_numel}, at::TensorOptions().dtype(t.dtype));
  if (t.storage_numel > 0) pread_all(storage.data_ptr(), t.storage_numel * es, offset);
  try {
    return storage.as_strided(t.sizes, t.strides, t.offset).contiguous();
  } catch (const c10::Error& e) {
    throw IoError(path_ + ": " + t.record + ": a tensor its storage cannot hold: " +
                  std::string(e.what_without_backtrace()).substr(0, 200));
  }
}

void Archive::read_floats(const TensorRef& t, int64_t first, int64_t count, float* dst) const {
  if (first < 0 || count < 0 || first + count > t.numel())
    throw IoError(path_ + ": elements [" + std::to_string(first) + ", " + std::to_string(first + count) +
                  ") read from " + t.record + ", a tensor of " + std::to_string(t.numel()));
  if (!t.contiguous()) {
    at::Tensor all = read(t).reshape({-1}).narrow(0, first, count).to(at::kFloat);
    std::memcpy(dst, all.data_ptr<float>(), static_cast<size_t>(count) * sizeof(float));
    return;
  }
  const auto [offset, bytes] = record(t.record);
  (void)bytes;
  const int64_t es = static_cast<int64_t>(c10::elementSize(t.dtype));
  const int64_t at_byte = offset + (t.offset + first) * es;
  if (t.dtype == at::kFloat) {
    pread_all(dst, count * es, at_byte);
    return;
  }
  at::Tensor raw = at::empty({count}, at::TensorOptions().dtype(t.dtype));
  if (count > 0) pread_all(raw.data_ptr(), count * es, at_byte);
  if (!at::isFloatingType(t.dtype)) throw IoError(path_ + ": " + t.record + " holds " + c10::toString(t.dtype) + ", not a float state");
  at::from_blob(dst, {count}, at::kFloat).copy_(raw);
}

// ---------------------------------------------------------------- writing

namespace {

class Emitter {
 public:
  explicit Emitter(std::vector<at::Tensor>* tensors) : tensors_(tensors) {}
  std::string out;

  void value(const Value& v) {
    switch (v.kind) {
      case Value::Kind::kNone: op('N'); break;
      case Value::Kind::kBool: op(v.b ? 0x88 : 0x89); break;
      case Value::Kind::kInt: integer(v.i); break;
      case Value::Kind::kFloat: {
        op('G');
        uint64_t bits;
        std::memcpy(&bits, &v.f, 8);
        for (int k = 7; k >= 0; --k) out += static_cast<char>((bits >> (8 * k)) & 0xFF);
        break;
      }
      case Value::Kind::kStr: str(v.s); break;
      case Value::Kind::kBytes:  // protocol 2: _codecs.encode(latin-1 text, 'latin1')
        global("_codecs", "encode");
        {
          std::string text;
          for (char c : v.s) {
            const auto u = static_cast<uint8_t>(c);
            if (u < 0x80) text += c;
            else {
              text += static_cast<char>(0xC0 | (u >> 6));
              text += static_cast<char>(0x80 | (u & 0x3F));
            }
          }
          str(text);
        }
        str("latin1");
        op(0x86);
        op('R');
        break;
      case Value::Kind::kTuple:
        op('(');
        for (const auto& x : v.items) value(*x);
        op('t');
        break;
      case Value::Kind::kList:
        op(']');
        if (!v.items.empty()) {
          op('(');
          for (const auto& x : v.items) value(*x);
          op('e');
        }
        break;
      case Value::Kind::kSize:
        global("torch", "Size");
        op('(');
        for (const auto& x : v.items) value(*x);
        op('t');
        op(0x85);
        op('R');
        break;
      case Value::Kind::kDict:
        if (v.ordered) {
          global("collections", "OrderedDict");
          op(')');
          op('R');
        } else {
          op('}');
        }
        items(v.entries);
        break;
      case Value::Kind::kObject: {
        const size_t dot = v.s.rfind('.');
        global(v.s.substr(0, dot), v.s.substr(dot + 1));
        op(')');
        op(0x81);  // NEWOBJ
        op('}');
        items(v.entries);
        op('b');  // BUILD
        break;
      }
      case Value::Kind::kTensor: tensor(v.data); break;
      case Value::Kind::kGlobal:
      case Value::Kind::kStorage: throw InternalError("pickle: a read-only value (" + v.kind_name() + ") given to write");
    }
  }

 private:
  void op(int c) { out += static_cast<char>(c); }
  void u32(uint32_t n) {
    for (int k = 0; k < 4; ++k) out += static_cast<char>((n >> (8 * k)) & 0xFF);
  }
  void integer(int64_t i) {
    if (i >= 0 && i < 256) {
      op('K');
      out += static_cast<char>(i);
    } else if (i >= INT32_MIN && i <= INT32_MAX) {
      op('J');
      u32(static_cast<uint32_t>(static_cast<int32_t>(i)));
    } else {
      op(0x8a);  // LONG1, 8 bytes two's complement
      out += static_cast<char>(8);
      for (int k = 0; k < 8; ++k) out += static_cast<char>((static_cast<uint64_t>(i) >> (8 * k)) & 0xFF);
    }
  }
  void str(const std::string& s) {
    op('X');
    u32(static_cast<uint32_t>(s.size()));
    out += s;
  }
  void global(const std::string& module, const std::string& name) {
    op('c');
    out += module + "\n" + name + "\n";
  }
  void items(const std::vector<std::pair<ValuePtr, ValuePtr>>& entries) {
    if (entries.empty()) return;
    op('(');
    for (const auto& [k, x] : entries) {
      value(*k);
      value(*x);
    }
    op('u');
  }
  void tensor(const at::Tensor& t_in) {
    const at::Tensor t = t_in.contiguous();
    const std::string key = std::to_string(tensors_->size());
    tensors_->push_back(t);
    static const std::map<at::ScalarType, const char*> types{
        {at::kFloat, "FloatStorage"}, {at::kDouble, "DoubleStorage"}, {at::kHalf, "HalfStorage"},
        {at::kBFloat16, "BFloat16Storage"}, {at::kLong, "LongStorage"}, {at::kInt, "IntStorage"},
        {at::kShort, "ShortStorage"}, {at::kChar, "CharStorage"}, {at::kByte, "ByteStorage"}, {at::kBool, "BoolStorage"}};
    auto it = types.find(t.scalar_type());
    if (it == types.end()) throw InternalError("pickle: a tensor of dtype " + std::string(c10::toString(t.scalar_type())));
    global("torch._utils", "_rebuild_tensor_v2");
    op('(');
    op('(');  // the persistent id
    str("storage");
    global("torch", it->second);
    str(key);
    str("cpu");
    integer(t.numel());
    op('t');
    op('Q');
    integer(0);
    op('(');
    for (int64_t d : t.sizes()) integer(d);
    op('t');
    op('(');
    for (int64_t d : t.strides()) integer(d);
    op('t');
    op(0x89);  // requires_grad False
    global("collections", "OrderedDict");
    op(')');
    op('R');
    op('t');
    op('R');
  }
  std::vector<at::Tensor>* tensors_;
};

}  // namespace

std::string serialize(const Value& root, std::vector<at::Tensor>* tensors) {
  Emitter e(tensors);
  e.out = "\x80\x02";
  e.value(root);
  e.out += '.';
  return e.out;
}

void save(const std::string& path, const Value& root) {
  std::vector<at::Tensor> tensors;
  const std::string pkl = serialize(root, &tensors);
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) throw IoError("open " + tmp + " for writing: " + std::strerror(errno));
  int write_errno = 0;
  try {
    // Records under "archive/", as torch.save names them when writing to a buffer.
    caffe2::serialize::PyTorchStreamWriter zip([&](const void* data, size_t n) -> size_t {
      if (n > 0 && std::fwrite(data, 1, n, f) != n && write_errno == 0) write_errno = errno == 0 ? EIO : errno;
      return n;
    });
    zip.writeRecord("data.pkl", pkl.data(), pkl.size());
    zip.writeRecord("byteorder", "little", 6);
    for (size_t k = 0; k < tensors.size(); ++k)
      zip.writeRecord("data/" + std::to_string(k), tensors[k].data_ptr(),
                      static_cast<size_t>(tensors[k].numel()) * tensors[k].element_size());
    zip.writeEndOfFile();
  } catch (const c10::Error& e) {
    std::fclose(f);
    ::unlink(tmp.c_str());
    throw IoError("write " + tmp + ": " + std::string(e.what_without_backtrace()).substr(0, 200));
  }
  if (std::fflush(f) != 0 && write_errno == 0) write_errno = errno;
  if (write_errno == 0 && ::fsync(fileno(f)) != 0) write_errno = errno;
  std::fclose(f);
  if (write_errno != 0) {
    ::unlink(tmp.c_str());
    throw IoError("write " + tmp + ": " + std::strerror(write_errno));
  }
  rename_path(tmp, path);
}

}  // namespace zero::ckpt::pickle
