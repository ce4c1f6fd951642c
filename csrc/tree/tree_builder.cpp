// Prefix-forest builder: the C++ twin of forge_megatron/tree/build.py::build_python (same algorithm, same output).
//
// Input: a flat int64 token buffer [P] and int64 offsets [S+1] (sample s is tokens[offsets[s]:offsets[s+1]]).
// 1. Insert every sample into a token-level trie keyed by (parent node, token); nodes are numbered in creation
//    order, so parents precede children and siblings are ordered by first appearance. A node's first child is
//    stored beside it, later children in a hash table. Once a sample creates a node, the rest of that sample
//    is new, so lookups stop and only inserts remain.
// 2. Subtree sizes in one reverse pass; 3. DFS pre-order index in one forward pass.
// Output (numpy): tokens int64 [T], position_ids int64 [T], sub_end int32 [T], sample_nodes int64 [P].

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// Open-addressing map (parent, token) -> child node for all but the first child of each node.
// Capacity is fixed up front (>= 2x the entry bound); one slot is one cache-line-friendly struct.
class EdgeTable {
 public:
  explicit EdgeTable(int64_t max_entries) {
    uint64_t cap = 16;
    while (cap < 2 * static_cast<uint64_t>(max_entries)) cap <<= 1;
    mask_ = cap - 1;
    slots_.assign(cap, Slot{0, 0, -1});
  }

  int64_t find(int64_t parent, int64_t token) const {
    for (uint64_t i = hash(parent, token);; i = (i + 1) & mask_) {
      const Slot& slot = slots_[i];
      if (slot.child < 0) return -1;
      if (slot.parent == parent && slot.token == token) return slot.child;
    }
  }

  void insert(int64_t parent, int64_t token, int64_t child) {
    uint64_t i = hash(parent, token);
    while (slots_[i].child >= 0) i = (i + 1) & mask_;
    slots_[i] = Slot{parent, token, child};
  }

 private:
  struct Slot {
    int64_t parent, token, child;
  };

  uint64_t hash(int64_t parent, int64_t token) const {
    uint64_t x = static_cast<uint64_t>(parent) * 0x9E3779B97F4A7C15ULL ^ static_cast<uint64_t>(token);
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return x & mask_;
  }

  uint64_t mask_;
  std::vector<Slot> slots_;
};

// Token-level trie. The first child of a node is kept beside the node (no hashing on the common path: a
// chain, or the first sample through a branch); later children go to the EdgeTable. Index 0 is a virtual
// root above all real roots, so node n lives at n + 1 in first_child / branched.
class Trie {
 public:
  explicit Trie(int64_t max_nodes) : first_child(max_nodes + 1, -1), branched(max_nodes + 1, 0), edges(max_nodes) {
    parent.reserve(max_nodes);
    token.reserve(max_nodes);
    depth.reserve(max_nodes);
  }

  int64_t find(int64_t node, int64_t tok) const {
    const int64_t first = first_child[node + 1];
    if (first < 0) return -1;
    if (token[first] == tok) return first;
    return branched[node + 1] ? edges.find(node, tok) : -1;
  }

  int64_t add(int64_t node, int64_t tok, int64_t d) {
    const int64_t child = static_cast<int64_t>(parent.size());
    if (first_child[node + 1] < 0) {
      first_child[node + 1] = child;
    } else {
      branched[node + 1] = 1;
      edges.insert(node, tok, child);
    }
    parent.push_back(node);
    token.push_back(tok);
    depth.push_back(d);
    return child;
  }

  std::vector<int64_t> parent, token, depth;  // per node, creation order; parent -1 marks a root

 private:
  std::vector<int64_t> first_child;
  std::vector<uint8_t> branched;
  EdgeTable edges;
};

// Insert every sample; returns the trie node of every sample token.
std::vector<int64_t> insert_all(Trie& trie, const int64_t* tokens, const int64_t* offsets, int64_t num_samples) {
  std::vector<int64_t> node_of_token(offsets[num_samples]);
  for (int64_t s = 0; s < num_samples; ++s) {
    int64_t node = -1;
    bool fresh = false;  // true once this sample has created a node: everything after is new
    for (int64_t pos = offsets[s]; pos < offsets[s + 1]; ++pos) {
      int64_t child = fresh ? -1 : trie.find(node, tokens[pos]);
      if (child < 0) {
        child = trie.add(node, tokens[pos], pos - offsets[s]);
        fresh = true;
      }
      node_of_token[pos] = child;
      node = child;
    }
  }
  return node_of_token;
}

std::vector<int64_t> subtree_sizes(const std::vector<int64_t>& parent) {
  std::vector<int64_t> size(parent.size(), 1);
  for (int64_t node = static_cast<int64_t>(parent.size()) - 1; node >= 0; --node) {
    if (parent[node] >= 0) size[parent[node]] += size[node];
  }
  return size;
}

std::vector<int64_t> preorder(const std::vector<int64_t>& parent, const std::vector<int64_t>& size) {
  std::vector<int64_t> pre(parent.size()), next_free(parent.size());
  int64_t next_root = 0;
  for (size_t node = 0; node < parent.size(); ++node) {
    const int64_t p = parent[node];
    if (p < 0) {
      pre[node] = next_root;
      next_root += size[node];
    } else {
      pre[node] = next_free[p];
      next_free[p] += size[node];
    }
    next_free[node] = pre[node] + 1;
  }
  return pre;
}

void check_inputs(const I64Array& tokens, const I64Array& offsets) {
  if (tokens.ndim() != 1 || offsets.ndim() != 1) throw std::invalid_argument("tokens and offsets must be 1-D arrays");
  if (offsets.shape(0) < 2) throw std::invalid_argument("offsets must hold at least one sample (length >= 2)");
  const int64_t* off = offsets.data();
  const int64_t num_samples = offsets.shape(0) - 1;
  if (off[0] != 0) throw std::invalid_argument("offsets[0] must be 0, got " + std::to_string(off[0]));
  for (int64_t s = 0; s < num_samples; ++s) {
    if (off[s + 1] <= off[s]) throw std::invalid_argument("sample " + std::to_string(s) + " is empty or offsets decrease");
  }
  if (off[num_samples] != tokens.shape(0)) {
    throw std::invalid_argument("offsets[-1] = " + std::to_string(off[num_samples]) + " but there are " +
                                std::to_string(tokens.shape(0)) + " tokens");
  }
  if (tokens.shape(0) > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument("more than 2^31-1 tokens: sub_end is int32");
  }
  const int64_t* tok = tokens.data();
  for (int64_t i = 0; i < tokens.shape(0); ++i) {
    if (tok[i] < 0) throw std::invalid_argument("negative token id " + std::to_string(tok[i]) + " at flat position " + std::to_string(i));
  }
}

py::tuple build(const I64Array& tokens, const I64Array& offsets) {
  check_inputs(tokens, offsets);
  const int64_t num_samples = offsets.shape(0) - 1;
  const int64_t total = tokens.shape(0);
  Trie trie(total);
  std::vector<int64_t> node_of_token, size, pre;
  {
    py::gil_scoped_release release;
    node_of_token = insert_all(trie, tokens.data(), offsets.data(), num_samples);
    size = subtree_sizes(trie.parent);
    pre = preorder(trie.parent, size);
  }
  const int64_t T = static_cast<int64_t>(trie.parent.size());
  py::array_t<int64_t> out_tokens(T), out_pos(T), out_nodes(total);
  py::array_t<int32_t> out_sub_end(T);
  int64_t* tok = out_tokens.mutable_data();
  int64_t* pos = out_pos.mutable_data();
  int32_t* sub_end = out_sub_end.mutable_data();
  int64_t* nodes = out_nodes.mutable_data();
  for (int64_t n = 0; n < T; ++n) {
    tok[pre[n]] = trie.token[n];
    pos[pre[n]] = trie.depth[n];
    sub_end[pre[n]] = static_cast<int32_t>(pre[n] + size[n]);
  }
  for (int64_t p = 0; p < total; ++p) nodes[p] = pre[node_of_token[p]];
  return py::make_tuple(out_tokens, out_pos, out_sub_end, out_nodes);
}

}  // namespace

PYBIND11_MODULE(_C_tree, m) {
  m.doc() = "C++ prefix-forest builder (see forge_megatron/tree/build.py for the algorithm and the reference)";
  m.def("build", &build, py::arg("tokens"), py::arg("offsets"),
        "Build the DFS-ordered prefix forest: returns (tokens int64[T], position_ids int64[T], sub_end int32[T], "
        "sample_nodes int64[P]).");
}
