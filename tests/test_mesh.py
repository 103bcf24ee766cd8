import jax
import pytest
from jax.sharding import AxisType

from shardax import DeviceMeshManager, get_mesh_info, parse_mesh_shape


@pytest.mark.parametrize(
    "shape",
    [{"data": 4, "model": 2}, [("data", 4), ("model", 2)], "data=4,model=2", "data=-1,model=2",
     {"data": 4, "model": -1}],
)
def test_create_device_mesh_accepts_every_spelling(shape):
    mesh = DeviceMeshManager().create_device_mesh(shape)
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert mesh.axis_names == ("data", "model")
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_mesh_uses_jax_topology_order():
    mesh = DeviceMeshManager().create_device_mesh("data=2,model=4")
    expected = jax.make_mesh((2, 4), ("data", "model"))
    assert [d.id for d in mesh.devices.flat] == [d.id for d in expected.devices.flat]


def test_axis_types_are_an_explicit_choice():
    manager = DeviceMeshManager()
    assert manager.create_device_mesh("data=8").axis_types == (AxisType.Auto,)
    explicit = manager.create_device_mesh("data=4,model=2", axis_types="explicit")
    assert explicit.axis_types == (AxisType.Explicit, AxisType.Explicit)
    assert (DeviceMeshManager(axis_types="explicit").create_data_parallel_mesh().axis_types
            == (AxisType.Explicit,))
    with pytest.raises(ValueError, match="axis_types='manual' is not one of 'auto', 'explicit'"):
        manager.create_device_mesh("data=8", axis_types="manual")


def test_smaller_product_uses_the_first_devices():
    mesh = DeviceMeshManager().create_device_mesh({"data": 4})
    assert mesh.devices.size == 4


def test_named_constructors():
    manager = DeviceMeshManager()
    assert dict(manager.create_data_parallel_mesh().shape) == {"data": 8}
    assert dict(manager.create_data_parallel_mesh(4, axis_name="batch").shape) == {"batch": 4}
    assert dict(manager.create_model_parallel_mesh().shape) == {"model": 8}
    assert dict(manager.create_hybrid_mesh(2, 4).shape) == {"data": 2, "model": 4}
    assert dict(manager.create_hybrid_mesh(-1, 2).shape) == {"data": 4, "model": 2}


def test_multi_slice_mesh_on_one_process():
    mesh = DeviceMeshManager().create_multi_slice_mesh("data=4,model=2", "data=1,model=1")
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_get_mesh_info():
    manager = DeviceMeshManager()
    info = manager.get_mesh_info(manager.create_device_mesh("data=2,model=4"))
    assert info["axis_names"] == ("data", "model")
    assert info["axis_sizes"] == {"data": 2, "model": 4}
    assert info["shape"] == "data=2,model=4"
    assert info["num_devices"] == 8 and sorted(info["devices"]) == list(range(8))
    assert info["platform"] == "cpu"
    assert info["process_count"] == 1
    assert info["axis_types"] == ("auto", "auto")
    assert get_mesh_info(manager.create_device_mesh("data=8"))["axis_sizes"] == {"data": 8}


@pytest.mark.parametrize(
    "shape, message",
    [
        ("data=4,model=4",
         (r"mesh shape 'data=4,model=4' needs 16 devices but only 8 are available; .* "
          r"e\.g\. 'data=2,model=4'")),
        ("data=-1,model=-1", "more than one -1 axis"),
        ("data=3,model=-1",
         r"8 devices do not divide by the other axes' product 3.* e\.g\. 'data=1,model=8'|e\.g\."),
        ({"data": 2, "data ": 2}, None),
        ([("data", 2), ("data", 4)], "names axis 'data' twice"),
        ({"": 8}, "empty axis name"),
        ("data:8", "is not 'name=size'"),
        ({"data": 0}, "has size 0"),
        ({}, "has no axes"),
    ],
)
def test_bad_mesh_shapes_are_one_line_errors(shape, message):
    manager = DeviceMeshManager()
    if message is None:  # 'data' and 'data ' are different names: this one is valid
        assert manager.create_device_mesh(shape).devices.size == 4
        return
    with pytest.raises(ValueError, match=message) as info:
        manager.create_device_mesh(shape)
    assert "\n" not in str(info.value)


def test_errors_name_device_count_and_a_working_shape():
    with pytest.raises(ValueError) as info:
        DeviceMeshManager().create_device_mesh("data=3,model=-1")
    text = str(info.value)
    assert "8 devices" in text and "'data=3,model=-1'" in text
    suggestion = text.split("e.g. ")[1].strip("'")
    assert DeviceMeshManager().create_device_mesh(suggestion).devices.size == 8


def test_parse_mesh_shape_keeps_order():
    assert parse_mesh_shape("model=2, data=-1") == [("model", 2), ("data", -1)]
