// DeviceMesh: validation, per-dimension groups, slicing and flattening.
#include "device_mesh/device_mesh.h"

#include <algorithm>
#include <set>
#include <sstream>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace fsdp {

struct DeviceMesh::State {
  std::shared_ptr<collectives::World> world;
  c10::DeviceType device_type = c10::kCPU;
  // int64, CPU, contiguous; never modified after construction.
  at::Tensor mesh;
  // Empty for an unnamed mesh, else one unique non-empty name per dim.
  std::vector<std::string> dim_names;
  // groups[d] is this rank's communicator along dim d. Shared because slices
  // and copies of a mesh use the very same communicators as their parent.
  std::vector<std::shared_ptr<collectives::Communicator>> groups;
  // This rank's index along each dim.
  std::vector<int64_t> coordinate;
  // Options for the groups this mesh creates later (flatten).
  collectives::CommunicatorOptions options;
};

namespace {

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::ostringstream out;
  for (size_t i = 0; i < items.size(); ++i) out << (i ? sep : "") << items[i];
  return out.str();
}

std::string quoted_list(const std::vector<std::string>& names) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < names.size(); ++i) out << (i ? ", " : "") << '"' << names[i] << '"';
  out << "]";
  return out.str();
}

// Nested-list rendering of an int64 tensor: [[0, 1], [2, 3]].
void format_ranks(std::ostringstream& out, const at::Tensor& t) {
  if (t.dim() == 0) {
    out << t.item<int64_t>();
    return;
  }
  out << "[";
  for (int64_t i = 0; i < t.size(0); ++i) {
    if (i) out << ", ";
    format_ranks(out, t.select(0, i));
  }
  out << "]";
}

std::string format_mesh(c10::DeviceType device_type, const at::Tensor& mesh, const std::vector<std::string>& names) {
  std::ostringstream out;
  out << "DeviceMesh(" << c10::DeviceTypeName(device_type, /*lower_case=*/true) << ", ";
  format_ranks(out, mesh);
  if (!names.empty()) out << ", dim_names=" << quoted_list(names);
  out << ")";
  return out.str();
}

// The ranks along `dim` through `coordinate` (the other coordinates fixed).
std::vector<int> line_through(const at::Tensor& mesh, int64_t dim, const std::vector<int64_t>& coordinate) {
  at::Tensor line = mesh;
  // Select from the last dim down so that earlier dim indices stay valid.
  for (int64_t e = mesh.dim() - 1; e >= 0; --e) {
    if (e != dim) line = line.select(e, coordinate[e]);
  }
  std::vector<int> ranks;
  ranks.reserve(line.numel());
  auto acc = line.accessor<int64_t, 1>();
  for (int64_t i = 0; i < line.size(0); ++i) ranks.push_back(static_cast<int>(acc[i]));
  return ranks;
}

// Checks `mesh` and the names and returns the canonical (int64, CPU,
// contiguous, owned) mesh tensor and this rank's coordinate.
std::pair<at::Tensor, std::vector<int64_t>> validate_layout(const collectives::World& world,
                                                            c10::DeviceType device_type, const at::Tensor& mesh_in,
                                                            const std::vector<std::string>& dim_names) {
  TORCH_CHECK(mesh_in.defined(), "DeviceMesh: the mesh tensor is undefined");
  TORCH_CHECK(mesh_in.dim() >= 1, "DeviceMesh: the mesh tensor must have at least one dim, got a ", mesh_in.dim(),
              "-d tensor");
  TORCH_CHECK(!c10::isFloatingType(mesh_in.scalar_type()) && !c10::isComplexType(mesh_in.scalar_type()) &&
                  mesh_in.scalar_type() != at::kBool,
              "DeviceMesh: the mesh tensor must hold integer ranks, got dtype ", mesh_in.scalar_type());
  TORCH_CHECK(mesh_in.numel() >= 1, "DeviceMesh: the mesh tensor is empty (shape ", mesh_in.sizes(), ")");
  at::Tensor mesh = mesh_in.detach().to(at::kCPU, at::kLong).contiguous().clone();
  const std::string where = format_mesh(device_type, mesh, dim_names);

  const int64_t* ranks = mesh.const_data_ptr<int64_t>();
  std::set<int64_t> seen;
  int64_t my_index = -1;
  for (int64_t i = 0; i < mesh.numel(); ++i) {
    const int64_t r = ranks[i];
    TORCH_CHECK(r >= 0 && r < world.size(), "DeviceMesh: rank ", r, " in ", where, " is out of range [0, ",
                world.size(), ") for ", world.description());
    TORCH_CHECK(seen.insert(r).second, "DeviceMesh: rank ", r, " appears more than once in ", where);
    if (r == world.rank()) my_index = i;
  }
  TORCH_CHECK(my_index >= 0, "DeviceMesh: this rank (", world.rank(), ") is not in ", where,
              "; every rank that builds a mesh must be part of it");

  if (!dim_names.empty()) {
    TORCH_CHECK(static_cast<int64_t>(dim_names.size()) == mesh.dim(), "DeviceMesh: ", dim_names.size(), " dim names ",
                quoted_list(dim_names), " given for a ", mesh.dim(), "-d mesh ", format_mesh(device_type, mesh, {}),
                "; give one name per dim");
    std::set<std::string> names;
    for (const auto& name : dim_names) {
      TORCH_CHECK(!name.empty(), "DeviceMesh: empty dim name in ", quoted_list(dim_names));
      TORCH_CHECK(names.insert(name).second, "DeviceMesh: dim name \"", name, "\" appears more than once in ",
                  quoted_list(dim_names));
    }
  }

  // Row-major coordinate of this rank.
  std::vector<int64_t> coordinate(mesh.dim());
  int64_t rest = my_index;
  for (int64_t d = mesh.dim() - 1; d >= 0; --d) {
    coordinate[d] = rest % mesh.size(d);
    rest /= mesh.size(d);
  }
  return {mesh, coordinate};
}

}  // namespace

DeviceMesh::DeviceMesh(std::shared_ptr<const State> state) : state_(std::move(state)) {}

DeviceMesh::DeviceMesh(std::shared_ptr<collectives::World> world, c10::DeviceType device_type, const at::Tensor& mesh,
                       std::vector<std::string> dim_names, const collectives::CommunicatorOptions& options) {
  TORCH_CHECK(world != nullptr, "DeviceMesh: the world is null");
  auto [layout, coordinate] = validate_layout(*world, device_type, mesh, dim_names);
  auto state = std::make_shared<State>();
  state->world = std::move(world);
  state->device_type = device_type;
  state->mesh = std::move(layout);
  state->dim_names = std::move(dim_names);
  state->coordinate = std::move(coordinate);
  state->options = options;
  // Dims in order: every member of a group reaches its new_group call in the
  // same position, so the World's per-member-list counters agree.
  for (int64_t d = 0; d < state->mesh.dim(); ++d) {
    state->groups.push_back(
        state->world->new_group(line_through(state->mesh, d, state->coordinate), device_type, options));
  }
  state_ = std::move(state);
}

DeviceMesh DeviceMesh::from_communicators(std::shared_ptr<collectives::World> world, const at::Tensor& mesh,
                                          std::vector<std::shared_ptr<collectives::Communicator>> groups,
                                          std::vector<std::string> dim_names) {
  TORCH_CHECK(world != nullptr, "DeviceMesh::from_communicators: the world is null");
  TORCH_CHECK(!groups.empty() && groups.front() != nullptr,
              "DeviceMesh::from_communicators: give one communicator per mesh dim");
  const c10::DeviceType device_type = groups.front()->device_type();
  auto [layout, coordinate] = validate_layout(*world, device_type, mesh, dim_names);
  const std::string where = format_mesh(device_type, layout, dim_names);
  TORCH_CHECK(static_cast<int64_t>(groups.size()) == layout.dim(), "DeviceMesh::from_communicators: ", groups.size(),
              " communicators given for the ", layout.dim(), "-d mesh ", where, "; give one per dim");
  for (int64_t d = 0; d < layout.dim(); ++d) {
    const auto& group = groups[d];
    TORCH_CHECK(group != nullptr, "DeviceMesh::from_communicators: communicator ", d, " is null");
    TORCH_CHECK(group->device_type() == device_type, "DeviceMesh::from_communicators: communicator ", d, " (",
                group->name(), ") is on ", group->device_type(), " but communicator 0 is on ", device_type);
    const std::vector<int> expected = line_through(layout, d, coordinate);
    TORCH_CHECK(group->global_ranks() == expected, "DeviceMesh::from_communicators: communicator ", d, " (",
                group->name(), ") has members ", c10::ArrayRef<int>(group->global_ranks()), " but dim ", d, " of ",
                where, " through this rank (", world->rank(), ") is ", c10::ArrayRef<int>(expected));
  }
  auto state = std::make_shared<State>();
  state->world = std::move(world);
  state->device_type = device_type;
  state->mesh = std::move(layout);
  state->dim_names = std::move(dim_names);
  state->groups = std::move(groups);
  state->coordinate = std::move(coordinate);
  return DeviceMesh(std::shared_ptr<const State>(std::move(state)));
}

int64_t DeviceMesh::ndim() const { return state_->mesh.dim(); }

int64_t DeviceMesh::size(int64_t dim) const {
  TORCH_CHECK(dim >= 0 && dim < ndim(), "DeviceMesh::size: dim ", dim, " is out of range for ", to_string());
  return state_->mesh.size(dim);
}

int64_t DeviceMesh::size(const std::string& dim_name) const { return size(dim_index(dim_name)); }

int64_t DeviceMesh::size() const { return state_->mesh.numel(); }

c10::DeviceType DeviceMesh::device_type() const { return state_->device_type; }

const at::Tensor& DeviceMesh::mesh() const { return state_->mesh; }

const std::vector<std::string>& DeviceMesh::dim_names() const { return state_->dim_names; }

int64_t DeviceMesh::dim_index(const std::string& dim_name) const {
  const auto& names = state_->dim_names;
  TORCH_CHECK(!names.empty(), "DeviceMesh: no dim named \"", dim_name, "\": ", to_string(),
              " has no dim names (pass dim_names when building it)");
  auto it = std::find(names.begin(), names.end(), dim_name);
  TORCH_CHECK(it != names.end(), "DeviceMesh: no dim named \"", dim_name, "\" in ", to_string(), "; known names are ",
              quoted_list(names));
  return it - names.begin();
}

const std::shared_ptr<collectives::Communicator>& DeviceMesh::group(int64_t dim) const {
  TORCH_CHECK(dim >= 0 && dim < ndim(), "DeviceMesh::group: dim ", dim, " is out of range for ", to_string());
  return state_->groups[dim];
}

const std::shared_ptr<collectives::Communicator>& DeviceMesh::group(const std::string& dim_name) const {
  return group(dim_index(dim_name));
}

int64_t DeviceMesh::local_rank(int64_t dim) const {
  TORCH_CHECK(dim >= 0 && dim < ndim(), "DeviceMesh::local_rank: dim ", dim, " is out of range for ", to_string());
  return state_->coordinate[dim];
}

int64_t DeviceMesh::local_rank(const std::string& dim_name) const { return local_rank(dim_index(dim_name)); }

std::vector<int64_t> DeviceMesh::coordinate() const { return state_->coordinate; }

int DeviceMesh::global_rank() const { return state_->world->rank(); }

const std::shared_ptr<collectives::World>& DeviceMesh::world() const { return state_->world; }

DeviceMesh DeviceMesh::operator[](const std::string& dim_name) const { return slice({dim_name}); }

DeviceMesh DeviceMesh::slice(const std::vector<std::string>& dim_names) const {
  TORCH_CHECK(!dim_names.empty(), "DeviceMesh::slice: no dim names given for ", to_string());
  std::vector<int64_t> dims;
  for (const auto& name : dim_names) {
    const int64_t d = dim_index(name);
    TORCH_CHECK(std::find(dims.begin(), dims.end(), d) == dims.end(), "DeviceMesh::slice: dim \"", name,
                "\" appears more than once in ", quoted_list(dim_names));
    dims.push_back(d);
  }
  if (!std::is_sorted(dims.begin(), dims.end())) {
    std::vector<int64_t> sorted = dims;
    std::sort(sorted.begin(), sorted.end());
    std::vector<std::string> in_order;
    for (int64_t d : sorted) in_order.push_back(state_->dim_names[d]);
    TORCH_CHECK(false, "DeviceMesh::slice: dims ", quoted_list(dim_names), " are not in the order of ", to_string(),
                "; slice ", quoted_list(in_order), " instead");
  }
  auto state = std::make_shared<State>();
  state->world = state_->world;
  state->device_type = state_->device_type;
  at::Tensor sub = state_->mesh;
  for (int64_t e = ndim() - 1; e >= 0; --e) {
    if (std::find(dims.begin(), dims.end(), e) == dims.end()) sub = sub.select(e, state_->coordinate[e]);
  }
  state->mesh = sub.contiguous().clone();
  for (int64_t d : dims) {
    state->dim_names.push_back(state_->dim_names[d]);
    state->groups.push_back(state_->groups[d]);
    state->coordinate.push_back(state_->coordinate[d]);
  }
  state->options = state_->options;
  return DeviceMesh(std::shared_ptr<const State>(std::move(state)));
}

DeviceMesh DeviceMesh::flatten(const std::string& name) const {
  std::string flat_name = name;
  if (flat_name.empty() && !state_->dim_names.empty()) flat_name = join(state_->dim_names, "_");
  at::Tensor flat = state_->mesh.reshape({-1}).contiguous().clone();
  std::vector<int> ranks;
  ranks.reserve(flat.numel());
  const int64_t* data = flat.const_data_ptr<int64_t>();
  int64_t my_index = -1;
  for (int64_t i = 0; i < flat.numel(); ++i) {
    ranks.push_back(static_cast<int>(data[i]));
    if (data[i] == global_rank()) my_index = i;
  }
  auto state = std::make_shared<State>();
  state->world = state_->world;
  state->device_type = state_->device_type;
  state->mesh = flat;
  if (!flat_name.empty()) state->dim_names = {flat_name};
  state->coordinate = {my_index};
  state->options = state_->options;
  state->groups.push_back(state_->world->new_group(ranks, state_->device_type, state_->options));
  return DeviceMesh(std::shared_ptr<const State>(std::move(state)));
}

std::string DeviceMesh::to_string() const { return format_mesh(state_->device_type, state_->mesh, state_->dim_names); }

DeviceMesh init_device_mesh(std::shared_ptr<collectives::World> world, c10::DeviceType device_type,
                            const std::vector<int64_t>& shape, std::vector<std::string> dim_names,
                            const collectives::CommunicatorOptions& options) {
  TORCH_CHECK(world != nullptr, "init_device_mesh: the world is null");
  TORCH_CHECK(!shape.empty(), "init_device_mesh: the mesh shape is empty; give at least one dim");
  int64_t numel = 1;
  for (int64_t s : shape) {
    TORCH_CHECK(s >= 1, "init_device_mesh: mesh shape ", c10::IntArrayRef(shape), " has a dim of size ", s,
                "; every dim needs at least one rank");
    numel *= s;
  }
  TORCH_CHECK(numel == world->size(), "init_device_mesh: mesh shape ", c10::IntArrayRef(shape), " holds ", numel,
              " ranks but the world (", world->description(), ") has ", world->size(),
              "; the product of the shape must equal the world size");
  at::Tensor mesh = at::arange(numel, at::TensorOptions().dtype(at::kLong)).view(shape);
  return DeviceMesh(std::move(world), device_type, mesh, std::move(dim_names), options);
}

}  // namespace fsdp
