"""Draw where each strategy keeps one MLP weight and its Adam moment on 8 devices: docs/images/layouts.png.

    python docs/layouts.py [OUT.png]

Each panel is the weight ``blocks/mlp_in`` of a 2-layer ``TransformerLM`` ([layers, d_model,
d_ff], layer 0 drawn) as the strategy lays it out, read off the arrays' ``addressable_shards``:
each block of the matrix is coloured by the devices that hold it (one colour per device; a
block held by several devices is hatched and labelled with how many).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from shardax.cpu_devices import simulate_cpu_devices

simulate_cpu_devices(8)

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import optax  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from shardax import DeviceMeshManager, parallelize  # noqa: E402
from shardax.models.transformer import TransformerConfig, TransformerLM  # noqa: E402
from shardax.sharding.strategies import default_mesh  # noqa: E402

STRATEGIES = ["dp", "zero2", "fsdp", "tp", "fsdp_tp", "hsdp", "pp", "pp_tp"]
CONFIG = TransformerConfig(vocab_size=64, d_model=64, n_heads=4, n_layers=2, d_ff=128, seq_len=16)
OUT = Path(__file__).parent / "images" / "layouts.png"


def holders(array) -> dict[tuple[tuple[int, int], tuple[int, int]], list[int]]:
    """Each block of layer 0 of ``array`` ([layers, rows, columns]): the devices that hold it."""
    blocks: dict[tuple[tuple[int, int], tuple[int, int]], list[int]] = {}
    for shard in array.addressable_shards:
        layers, rows, columns = shard.index
        if (layers.start or 0) > 0:
            continue  # another stage's layer
        key = ((rows.start or 0, rows.stop or array.shape[1]), (columns.start or 0, columns.stop or array.shape[2]))
        blocks.setdefault(key, []).append(shard.device.id)
    return blocks


def draw(axis, blocks, shape, title) -> None:
    colours = plt.get_cmap("tab10")
    for ((r0, r1), (c0, c1)), devices in blocks.items():
        shared = len(devices) > 1
        axis.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=colours(min(devices) % 10),
                                 edgecolor="black", hatch="//" if shared else None, alpha=0.5 if shared else 0.9))
        label = f"x{len(devices)}" if shared else f"d{devices[0]}"
        axis.text((c0 + c1) / 2, (r0 + r1) / 2, label, ha="center", va="center", fontsize=7)
    axis.set_xlim(0, shape[2]), axis.set_ylim(shape[1], 0)
    axis.set_title(title, fontsize=9), axis.set_xticks([]), axis.set_yticks([])


def main() -> None:
    figure, axes = plt.subplots(2, len(STRATEGIES), figsize=(2.2 * len(STRATEGIES), 4.6))
    for column, name in enumerate(STRATEGIES):
        mesh = DeviceMeshManager().create_device_mesh(default_mesh(name))
        parallel = parallelize(lambda rngs: TransformerLM(CONFIG, rngs=rngs), optax.adam(1e-3), mesh, name)
        state = parallel.init(seed=0)
        weight = state.params["blocks"]["layers"]["mlp_in"][...]
        moment = state.opt_state[0].mu["blocks"]["layers"]["mlp_in"][...]
        mesh_text = ",".join(f"{a}={n}" for a, n in mesh.shape.items())
        draw(axes[0][column], holders(weight), weight.shape, f"{name}\n{mesh_text}")
        draw(axes[1][column], holders(moment), moment.shape, "Adam moment")
    axes[0][0].set_ylabel("weight (d_model x d_ff)"), axes[1][0].set_ylabel("its Adam moment")
    figure.suptitle("Where each strategy keeps one MLP weight on 8 devices (layer 0; d<i>: held by device i alone, "
                    "x<n>: by n devices)", fontsize=10)
    figure.tight_layout()
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    out.parent.mkdir(exist_ok=True)
    figure.savefig(out, dpi=90)
    print(out)


if __name__ == "__main__":
    main()
