"""Ray as the GPU machine gets it (the trimmed archive of ``make gpu-wheels``), without torch.

    PYTHONPATH=SITE python3.12 benchmarks/gpu/ray_smoke.py

Starts a local cluster the way ``tests/test_scale_ray.py`` does (``ray.init(num_cpus=2,
include_dashboard=False, ...)``), then uses what ``tl_dynamics.scale.ray_stats`` uses: an actor
(``num_gpus=0``; fractional GPUs where the cluster has one), ``ray.put`` / ``ray.wait`` /
``ray.kill``, a task's error as ``RayTaskError``, Ray Data's ``from_items``, ``from_arrow``,
``read_binary_files``, ``repartition``, ``map_batches`` and the block iterator with
``BlockAccessor``. Prints one line per check and ``ray smoke: ok`` at the end (exit 1 otherwise).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    start = time.perf_counter()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no report (the machine is offline)
    import ray
    import ray.data
    from ray.data.block import BlockAccessor

    print(f"ray {ray.__version__} from {Path(ray.__file__).parent}")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    print(f"local cluster up in {time.perf_counter() - start:.1f} s: {ray.cluster_resources()}")
    ray.data.DataContext.get_current().enable_progress_bars = False

    @ray.remote(num_cpus=1, num_gpus=0)
    class Doubler:
        def twice(self, ref_value):
            return [2 * v for v in ref_value]

        def fail(self):
            raise ValueError("planted")

    actor = Doubler.remote()
    ref = ray.put([1, 2, 3])
    ready, _ = ray.wait([actor.twice.remote(ref)], num_returns=1)
    assert ray.get(ready[0]) == [2, 4, 6]
    try:
        ray.get(actor.fail.remote())
    except ray.exceptions.RayTaskError as exc:
        assert "planted" in str(exc)
    else:
        raise AssertionError("the actor's error did not come back")
    ray.kill(actor)
    print("actor (num_gpus=0), put, wait, RayTaskError, kill: ok")
    if ray.cluster_resources().get("GPU", 0) >= 1:
        half = Doubler.options(num_gpus=0.5)
        two = [half.remote(), half.remote()]
        assert [ray.get(a.twice.remote([1])) for a in two] == [[2], [2]]
        print("two actors on half a GPU each: ok")

    import pyarrow as pa

    rows = ray.data.from_items([{"text": f"t{i}"} for i in range(10)]).repartition(3)
    lengths = rows.map_batches(lambda b: {"n": [len(t) for t in b["text"]]}, batch_size=4)
    assert sum(r["n"] for r in lengths.take_all()) == 2 * 10
    tables = ray.data.from_arrow([pa.table({"text": ["a", "bb"]}), pa.table({"text": ["ccc"]})])
    assert tables.count() == 3
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "corpus.txt"
        path.write_text("a = 1\nb = 2\n")
        files = ray.data.read_binary_files([str(path)], include_paths=True)
        bundles = files.iter_internal_ref_bundles()
        # a BlockEntry (as tl_dynamics.scale._ray_driver reads it)
        blocks = [ray.get(entry.ref) for bundle in bundles for entry in bundle.blocks]
        got = [row for b in blocks for row in BlockAccessor.for_block(b).iter_rows(False)]
        assert [r["bytes"] for r in got] == [b"a = 1\nb = 2\n"], got
    print("Ray Data from_items, repartition, map_batches, from_arrow, read_binary_files: ok")
    ray.shutdown()
    print(f"ray smoke: ok ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
