"""Reliability v3 (issue 20), the self-written format under attack: items 1, 2, 3, 5, 6, 7, 12, 13
and 20, each named after its item (the fuzz test of every field of a manifest and ``.metadata`` is
now the format fuzzer's field families, ``test_fuzz_format.py``).

A step directory is edited by hand and re-signed (the manifest's checksum is unkeyed: anyone who
can write the files can recompute it), so only the reader's checks stand between such a file and
memory. What must hold: the process never crashes, nothing that was not saved is ever returned,
and the step is restored exactly or refused with a CheckpointError, the older step restored.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.hostile import (
    RunsCode,
    assert_falls_back,
    assert_is_step,
    blank,
    node,
    rewrite_manifest,
    rewrite_metadata,
    run_child,
)
from torch.distributed.checkpoint.metadata import MetadataIndex

from nbckpt import Checkpointer, CheckpointError, ConfigError

# -- item 1: a heap overflow from a dtype whose storage is smaller than nbytes ----------------------

READ_EVERY_WAY = """
    import sys, warnings
    from nbckpt import Checkpointer, CheckpointError
    from nbckpt.integrations import export
    import torch
    warnings.simplefilter("ignore")
    with Checkpointer(sys.argv[1], mode="sync") as ckpt:
        state = {"w": torch.zeros(4096), "b": torch.zeros(64, dtype=torch.float64), "step": -1}
        print("restored", ckpt.restore(state), state["step"])
        for read in (lambda: ckpt.load(2), lambda: export(sys.argv[1] + "/step-000002", sys.argv[2])):
            try:
                read()
                print("read")
            except CheckpointError as exc:
                print("refused", str(exc).splitlines()[0])
"""


@pytest.mark.parametrize("dtype", ["quint4x2", "quint2x4", "qint8", "quint8", "qint32"])
def test_item01_a_dtype_smaller_than_its_nbytes_is_refused_without_a_crash(
    run: Path, tmp_path: Path, dtype: str
) -> None:
    rewrite_manifest(run / "step-000002", lambda m: node(m, "w").update(dtype=dtype))
    child = run_child(READ_EVERY_WAY, str(run), str(tmp_path / "out.pt"))
    assert child.returncode == 0, child.stderr[-2000:]  # before the fix: SIGABRT or SIGSEGV
    lines = child.stdout.splitlines()
    assert lines[0] == "restored 1 1", child.stdout
    assert (
        lines[1:]
        == [f"refused step-000002/manifest.json names dtype {dtype!r}, which nbckpt never writes"] * 2
    )


def test_item01_a_tensor_where_the_template_holds_an_int_is_checked_too(run: Path) -> None:
    def step_as_tensor(manifest: dict[str, Any]) -> None:
        step = node(manifest, "step")
        step.clear()
        step.update(t="tensor", key="step", dtype="quint4x2", shape=[4096], device="cpu")
        manifest["items"]["step"] = manifest["items"]["w"]

    rewrite_manifest(run / "step-000002", step_as_tensor)
    assert_falls_back(run, "names dtype 'quint4x2', which nbckpt never writes")


# -- items 2 and 3: bytes read into two tensors, and allocations bounded by the files -------------


def test_item02_two_tensors_over_the_same_bytes_are_refused(run: Path) -> None:
    def overlap(manifest: dict[str, Any]) -> None:
        w, b = manifest["items"]["w"][0], manifest["items"]["b"][0]
        b[:4] = [w[0], w[1] + 64, w[2] - 64, w[3] + 64]  # b's blob and bytes inside w's

    rewrite_manifest(run / "step-000002", overlap)
    assert_falls_back(run, "step-000002/manifest.json puts tensors' bytes over each other in")


def test_item03_twenty_thousand_tensors_over_one_megabyte_cost_no_memory(run: Path) -> None:
    def many(manifest: dict[str, Any]) -> None:
        w = manifest["items"]["w"][0]
        for index in range(20_000):
            key = f"x{index}"
            manifest["tree"]["items"].append(
                [key, {"t": "tensor", "key": key, "dtype": "float32", "shape": [4096], "device": "cpu"}]
            )
            manifest["items"][key] = [[w[0], w[1] + index % 7, w[2] - index % 7, w[3], [0], [4096]]]

    rewrite_manifest(run / "step-000002", many)
    child = run_child(
        """
        import resource, sys
        from nbckpt import Checkpointer, CheckpointError
        with Checkpointer(sys.argv[1], read_only=True) as ckpt:
            try:
                ckpt.load(2)
            except CheckpointError as exc:
                print(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
        """,
        str(run),
    )
    assert child.returncode == 0, child.stderr[-2000:]
    refusal, peak_mb = child.stdout.splitlines()
    assert refusal.startswith(
        "CheckpointError: step-000002/manifest.json puts tensors' bytes over each other"
    ), refusal
    assert int(peak_mb) < 1500, peak_mb  # before the fix: about 21 GB were allocated


# -- items 5 and 6: both readers (nbckpt's manifest, DCP's .metadata) agree on every byte ---------


def test_item05_an_item_pointed_at_its_own_zip_header_is_refused(run: Path) -> None:
    def to_header(manifest: dict[str, Any]) -> None:
        w = manifest["items"]["w"][0]
        w[3] = w[1]  # the data "starts" where the blob does: its zip header read as floats

    rewrite_manifest(run / "step-000002", to_header)
    assert_falls_back(run, "tensor 'w' reads differently through torch.load")
    with Checkpointer(run, read_only=True) as ckpt, pytest.raises(CheckpointError, match="reads differently"):
        ckpt.verify(2)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("shape", "entry 'w' does not match the manifest"),
        ("dtype", "entry 'w' does not match the manifest"),
        ("key", "entry 'w' is not in the manifest"),
    ],
)
def test_item05_a_tree_that_disagrees_with_the_dcp_metadata_is_refused(
    run: Path, edit: str, message: str
) -> None:
    def disagree(manifest: dict[str, Any]) -> None:
        w, chunk = node(manifest, "w"), manifest["items"]["w"][0]
        if edit == "shape":
            w["shape"], chunk[4], chunk[5] = [2048, 2], [0, 0], [2048, 2]
        elif edit == "dtype":
            w["dtype"] = "int32"
        else:  # renamed in the tree and its items alike: only .metadata still says "w"
            w["key"] = "v"
            manifest["tree"]["items"] = [["v" if k == "w" else k, n] for k, n in manifest["tree"]["items"]]
            manifest["items"]["v"] = manifest["items"].pop("w")

    rewrite_manifest(run / "step-000002", disagree)
    if edit != "key":
        assert_falls_back(run, message)
        return
    with Checkpointer(run, read_only=True) as ckpt:  # a step lacking 'w' is passed over for one that has it
        state = blank()
        with pytest.warns(UserWarning, match=r"restored step 1, the newest holding 'w', 'b', 'step'"):
            assert ckpt.restore(state) == 1
        assert_is_step(state, 1)
        for read in (ckpt.verify, ckpt.load):  # the readers that do not look for names refuse it
            with pytest.raises(CheckpointError, match=re.escape(message)):
                read(2)


def test_item05_a_tensor_key_that_is_not_its_place_in_the_tree_is_refused(run: Path) -> None:
    rewrite_manifest(run / "step-000002", lambda m: node(m, "w").update(key="b.x"))
    assert_falls_back(run, "step-000002/manifest.json puts tensor 'b.x' at 'w'")


def test_item06_a_shifted_chunk_offset_in_the_metadata_is_refused(run: Path) -> None:
    def rekey(metadata: Any) -> None:
        info = metadata.storage_data.pop(MetadataIndex("w", (0,)))
        metadata.storage_data[MetadataIndex("w", (1,))] = info

    rewrite_metadata(run / "step-000002", rekey)
    assert_falls_back(run, "the storage entry of 'w' at [0] is not where its data is")


def test_item06_a_storage_range_starting_inside_another_blob_is_refused(run: Path) -> None:
    def inside(metadata: Any) -> None:
        w = metadata.storage_data[MetadataIndex("w", (0,))]
        b = metadata.storage_data[MetadataIndex("b", (0,))]
        b.relative_path, b.offset = w.relative_path, w.offset + 128

    rewrite_metadata(run / "step-000002", inside)
    assert_falls_back(run, "the storage entry of 'b' at [0] is not where its data is")
    with (
        Checkpointer(run, read_only=True) as ckpt,
        pytest.raises(CheckpointError, match="not where its data is"),
    ):
        ckpt.verify(2)


# -- item 7: a pickle payload in .metadata is refused by every reader ------------------------------


def test_item07_a_payload_in_the_metadata_is_refused_by_restore_load_and_verify(
    run: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "payload-ran"
    (run / "step-000002" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    rewrite_manifest(run / "step-000002")
    assert_falls_back(run, "refusing to load global builtins.exec")
    with Checkpointer(run, read_only=True) as ckpt:
        for read in (ckpt.verify, ckpt.load):
            with pytest.raises(CheckpointError, match=r"refusing to load global builtins\.exec"):
                read(2)
    assert not marker.exists()


# -- item 12: a failed restore changes nothing -------------------------------------------------------


def _model_and_optimizer(groups: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    params = [list(model[0].parameters()), list(model[1].parameters())]
    optim = torch.optim.AdamW(
        [{"params": p} for p in params] if groups == 2 else [{"params": params[0] + params[1]}]
    )
    model(torch.randn(3, 8)).sum().backward()
    optim.step()
    return model, optim


def test_item12_an_optimizer_whose_groups_differ_leaves_the_model_as_it_was(tmp_path: Path) -> None:
    model, optim = _model_and_optimizer(groups=2, seed=0)
    fresh, other = _model_and_optimizer(groups=1, seed=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with Checkpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save({"model": model, "optim": optim}, step=1)
        with pytest.raises(
            ConfigError, match=r"optim: the checkpoint's optimizer has parameter groups of \[2, 2\]"
        ):
            ckpt.restore({"model": fresh, "optim": other})
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())  # the model is untouched


def test_item12_a_malformed_rng_record_sets_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with Checkpointer(run, mode="sync", capture_rng=True) as ckpt:
        for step in (1, 2):
            ckpt.save({"w": torch.full((4,), float(step)), "step": step}, step=step)
    rewrite_manifest(run / "step-000002", lambda m: m["rng"]["0"].update(torch="!!not base64"))
    torch.manual_seed(1234)
    expected = torch.get_rng_state()
    state = {"w": torch.zeros(4), "step": 0}
    with Checkpointer(run, read_only=True) as ckpt:
        with pytest.raises(CheckpointError, match="the manifest's RNG record is malformed"):
            ckpt.restore(state, step=2)
        assert torch.equal(torch.get_rng_state(), expected) and state["step"] == 0 and not state["w"].any()
        with pytest.warns(UserWarning, match="RNG record is malformed"):
            assert ckpt.restore(state) == 1  # the older step, its RNG streams included
    assert state["step"] == 1


CTRL_C_DURING_RESTORE = """
    import random, signal, sys, threading, torch
    from nbckpt import Checkpointer
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rng = random.Random(52)
    run = sys.argv[1]
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    saved = [p.detach().clone() for p in model.parameters()]
    with Checkpointer(run, mode="sync") as ckpt:
        ckpt.save({"model": model, "n": 1}, step=1)
    partial = interrupted = 0
    for trial in range(int(sys.argv[2])):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(-1.0)
        state = {"model": model, "n": 0}
        main = threading.main_thread().ident
        timer = threading.Timer(rng.uniform(0, 0.03), signal.pthread_kill, (main, signal.SIGINT))
        try:
            timer.start()
            with Checkpointer(run, read_only=True) as ckpt:
                ckpt.restore(state)
            timer.join()
        except KeyboardInterrupt:
            interrupted += 1
        timer.cancel()
        timer.join()
        restored = [torch.equal(p, s) for p, s in zip(model.parameters(), saved)]
        untouched = [bool((p == -1.0).all()) for p in model.parameters()]
        if not (all(restored) or all(untouched)):
            partial += 1
    print(f"interrupted {interrupted} partial {partial}")
"""


def test_item12_ctrl_c_during_restore_never_leaves_a_half_loaded_state(tmp_path: Path) -> None:
    child = run_child(CTRL_C_DURING_RESTORE, str(tmp_path / "run"), "52")
    assert child.returncode == 0, child.stderr[-2000:]
    interrupted, partial = (int(x) for x in re.findall(r"\d+", child.stdout.splitlines()[-1]))
    assert interrupted > 0, child.stdout  # the interrupts really landed
    assert partial == 0, child.stdout  # before the fix: 4 of 52


# -- item 13: a malformed value is a damaged step, not the caller's mistake ------------------------


@pytest.mark.parametrize(
    ("kind", "value", "message"),
    [
        ("float", "abc", "has a malformed float value"),
        ("path", 5, "has a malformed path value"),
        ("device", "nonsense:7x", "has a malformed device value"),
        ("dtype", "quint4x2", "has a malformed dtype value"),
        ("value", [1, 2], "has a malformed value value"),
    ],
)
def test_item13_a_malformed_value_node_falls_back_to_the_older_step(
    run: Path, kind: str, value: Any, message: str
) -> None:
    rewrite_manifest(run / "step-000002", lambda m: node(m, "step").update(t=kind, v=value))
    assert_falls_back(run, message)
    with Checkpointer(run, read_only=True) as ckpt:
        for read in (ckpt.load, ckpt.verify):
            with pytest.raises(CheckpointError, match=message):
                read(2)


def test_item13_a_namespace_with_a_key_that_is_no_name_is_refused(run: Path) -> None:
    def namespace(manifest: dict[str, Any]) -> None:
        node(manifest, "step").clear()
        node(manifest, "step").update(t="namespace", items=[[3, {"t": "value", "v": 1}]])

    rewrite_manifest(run / "step-000002", namespace)
    assert_falls_back(run, "has a malformed state tree")


# -- item 20: a plain dcp.load reads plain values and tuples without allow_partial_load -------------


def test_item20_plain_dcp_load_reads_values_and_tuples_as_nbckpt_wrote_them(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(6.0), "config": {"lr": 0.1, "betas": (0.9, 0.99), "name": "run", "n": None}}
    with Checkpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save(state, step=1)
    target = {"w": torch.zeros(6), "config": {"lr": 0.0, "betas": (0.0, 0.0), "name": "", "n": 5}}
    dcp.load(target, checkpoint_id=tmp_path / "step-000001", no_dist=True)  # no allow_partial_load
    assert torch.equal(target["w"], state["w"]) and target["config"] == state["config"]
