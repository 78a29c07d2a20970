"""Nothing lost, nothing run, nothing raw (issue 24): outputs never destroy inputs, no file we read
runs code, bad prompts and crafted statistics files give clear errors, and a fuzz loop over
mutated statistics files finds no raw exception and no silent accept."""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tl_dynamics import cli, files, models, scale, testing
from tl_dynamics import contextual_mlp as cm
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.contextual_mlp._mlp import SAVE_FORMAT
from tl_dynamics.scale import _corpus, _format

NAME = "tiny-random:gpt2"
CORPUS = [f"def f{i}(x):  return x * {i}" for i in range(10)]
LONG = "x = 1 + " * 40  # more tokens than the tiny models' context (64)


@pytest.fixture(scope="module")
def model():
    return testing.cached_model("gpt2")


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if a model gets loaded: the checks must come first."""

    def refuse(name=None):
        raise AssertionError(f"model {name!r} was loaded before the inputs were checked")

    monkeypatch.setattr(models, "resolve", refuse)


def run(model, prompts, out=None, **kw):
    kw.setdefault("progress", False)
    return scale.run_stats(model, prompts, out, batch_size=4, model_name=NAME, **kw)


def main(capsys, *argv):
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def stats_file(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("stats") / "s.safetensors"
    run(model, CORPUS[:6], path)
    return path


# ---------------------------------------------------------------------- 1. nothing lost
def test_stats_out_that_is_the_corpus_is_refused_even_through_links(tmp_path, capsys, no_loading):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS) + "\n")
    (tmp_path / "link.txt").symlink_to(corpus)
    os.link(corpus, tmp_path / "hard.txt")
    for out in (
        corpus,
        tmp_path / "link.txt",
        tmp_path / "hard.txt",
        tmp_path / "." / "corpus.txt",
    ):
        code, _, err = main(
            capsys,
            "stats",
            "--model",
            NAME,
            "--prompts",
            str(corpus),
            "--out",
            str(out),
            "--no-progress",
        )
        assert code == 2 and "is the same file as --prompts" in err, err
    assert corpus.read_text() == "\n".join(CORPUS) + "\n"


def test_report_stats_out_that_is_the_stats_file_is_refused(stats_file, tmp_path, capsys):
    before = stats_file.read_bytes()
    code, _, err = main(capsys, "report", "--stats", str(stats_file), "--out", str(stats_file))
    assert code == 2 and "is the same file as --stats" in err
    assert stats_file.read_bytes() == before


def test_an_output_over_a_model_folders_file_is_refused(tmp_path, capsys):
    folder = testing.hf_folder("gpt2", tmp_path / "hf")
    weights = folder / "model.safetensors"
    before = weights.read_bytes()
    for command in ("report", "heads"):
        code, _, err = main(capsys, command, "--model", str(folder), "--out", str(weights))
        assert code == 2 and "is the same file as --model" in err, err
    assert weights.read_bytes() == before


def test_a_checkpoint_is_never_replaced_without_resume(model, tmp_path, capsys, no_loading):
    out = tmp_path / "s.safetensors"
    partial = tmp_path / "s.safetensors.partial"
    partial.write_bytes(b"an unfinished run")
    (tmp_path / "c.txt").write_text("a = 1\n")  # the corpus is checked first
    code, _, err = main(
        capsys,
        "stats",
        "--model",
        NAME,
        "--prompts",
        str(tmp_path / "c.txt"),
        "--out",
        str(out),
        "--no-progress",
    )
    assert code == 2 and "a checkpoint of an unfinished run exists" in err and "--resume" in err
    with pytest.raises(TLDynamicsError, match="checkpoint of an unfinished run exists"):
        run(model, CORPUS, out)
    assert partial.read_bytes() == b"an unfinished run" and not out.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_or_impossible_output_folders_fail_before_any_work(tmp_path, capsys, no_loading):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    corpus = tmp_path / "c.txt"
    corpus.write_text("a = 1\n")
    for out, message in [
        (locked / "s.safetensors", "is not writable"),
        (a_file / "s.safetensors", "is a file, so nothing can be written"),
    ]:
        code, _, err = main(capsys, "stats", "--prompts", str(corpus), "--out", str(out))
        assert code == 2 and message in err, err
        code, _, err = main(capsys, "heads", "--out", str(out))
        assert code == 2 and message in err, err
    code, _, err = main(capsys, "report", "--stats", str(corpus), "--out", str(locked / "p.html"))
    assert code == 2 and "is not writable" in err


def test_writes_are_atomic(tmp_path, monkeypatch):
    path = tmp_path / "page.html"
    path.write_text("old page")
    path.chmod(0o640)

    def broken(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(TLDynamicsError, match=rf"could not write {path} \(disk full\)"):
        files.write_text(path, "new page")
    monkeypatch.undo()
    assert path.read_text() == "old page" and sorted(p.name for p in tmp_path.iterdir()) == [
        "page.html"
    ]  # no temporary file left behind
    files.write_text(path, "new page")
    assert path.read_text() == "new page" and path.stat().st_mode & 0o777 == 0o640


# ---------------------------------------------------------------------- 2. mixed corpora
def test_resume_refuses_a_different_corpus_by_name(model, tmp_path):
    out = tmp_path / "s.safetensors"
    a, b = tmp_path / "A.txt", tmp_path / "B.txt"
    a.write_text("\n".join(CORPUS) + "\n")
    b.write_text("\n".join(reversed(CORPUS)) + "\n")
    run(model, a, out, max_batches=1, checkpoint_every=1)
    with pytest.raises(
        TLDynamicsError,
        match=r"made from different prompts: it holds 4 prompts "
        r"\(hash [0-9a-f]{64}\), but the first 1 batches of "
        r"--prompts '.*B.txt' are 4 prompts",
    ):
        run(model, b, out, resume=True)
    shorter = tmp_path / "short.txt"
    shorter.write_text("a = 1\n")
    with pytest.raises(TLDynamicsError, match="are 1 prompts"):
        run(model, shorter, out, resume=True)
    assert not out.exists()
    done = run(model, a, out, resume=True)  # the right corpus still resumes
    assert done.n_prompts == len(CORPUS) and done == run(model, CORPUS)


# ---------------------------------------------------------------------- 3. nothing run
class _Marker:
    """Unpickling this creates ``path``: proof that a loader ran code from a file."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_no_loader_runs_code_from_a_crafted_file(tmp_path, capsys):
    marker = tmp_path / "RAN"
    payload = {"format": SAVE_FORMAT, "state": _Marker(marker)}
    as_torch = tmp_path / "mlp.pt"
    torch.save(payload, as_torch)
    as_pickle = tmp_path / "raw.pkl"
    as_pickle.write_bytes(pickle.dumps(_Marker(marker)))
    for crafted in (as_torch, as_pickle):
        with pytest.raises(TLDynamicsError, match="not a saved ContextualMLP.*pickle"):
            cm.ContextualMLP.load(crafted)
        with pytest.raises(TLDynamicsError, match="not a tl-dynamics statistics file"):
            scale.load_stats(crafted)
        assert (
            main(capsys, "report", "--stats", str(crafted), "--out", str(tmp_path / "p.html"))[0]
            == 2
        )
    # a TransformerLens checkpoint folder whose weights are a pickle
    native = tmp_path / "native"
    native.mkdir()
    (native / "config.json").write_text(
        json.dumps(dict(testing.NATIVE_VARIANTS["native"], d_vocab=512))
    )
    torch.save({"W": _Marker(marker)}, native / "model.safetensors")
    with pytest.raises(TLDynamicsError, match="not a readable safetensors file"):
        models.load_model(native)
    # a Hugging Face folder whose weights are a crafted pytorch_model.bin
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text((testing.hf_folder("gpt2") / "config.json").read_text())
    torch.save({"transformer.wte.weight": _Marker(marker)}, hf / "pytorch_model.bin")
    try:
        models.load_model(hf)
    except TLDynamicsError:
        pass
    assert not marker.exists(), "a loader ran code from a file it read"


# ---------------------------------------------------------------------- 4. bad prompts
def test_one_long_prompt_names_its_line_and_can_be_skipped_or_truncated(model, tmp_path):
    corpus = tmp_path / "corpus.txt"
    lines = CORPUS[:2] + [LONG] + CORPUS[2:6]
    corpus.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        TLDynamicsError,
        match=r"corpus.txt:3: the prompt has \d+ tokens but this "
        r"model's context is 64; pass --on-bad-lines truncate",
    ):
        run(model, corpus, tmp_path / "e.safetensors")
    skipped = run(model, corpus, tmp_path / "s.safetensors", on_long="skip")
    assert skipped.n_prompts == 6 and skipped.skipped == {"skipped_long": 1}
    clean = run(model, CORPUS[:6], on_long="skip")
    assert _format.to_bytes(clean.merge(clean)) != _format.to_bytes(skipped)  # counts differ
    assert skipped.odds_ratio.exact == clean.odds_ratio.exact  # the same prompts were used
    loaded = scale.load_stats(tmp_path / "s.safetensors")
    assert loaded.skipped == {"skipped_long": 1} and loaded == skipped
    html = scale.stats_page(loaded).to_html()
    assert (
        "1 longer than the model&#x27;s context, left out" in html
        or "1 longer than the model's context, left out" in html
    )
    cut = run(model, corpus, on_long="truncate")
    assert cut.n_prompts == 7 and cut.skipped == {"truncated": 1}
    adapter = ModelAdapter.of(model)
    kept = _corpus.PromptCheck("truncate", 64, _corpus.token_counter(adapter))("x", LONG)
    assert LONG.startswith(kept) and len(adapter.tokenize(kept).tokens[0]) <= 64
    assert _corpus.token_counter(adapter)(LONG[: len(kept) + 1]) > 64  # the longest that fits


def test_undecodable_lines_and_lone_surrogates_name_their_line(model, tmp_path, capsys):
    raw = tmp_path / "raw.txt"
    raw.write_bytes(b"a = 1\nb = \xff\xfe 2\nc = 3\n")
    with pytest.raises(TLDynamicsError, match=r"raw.txt:2: not valid UTF-8"):
        run(model, raw)
    out = tmp_path / "s.safetensors"
    assert run(model, raw, out, on_long="skip").skipped == {"skipped_undecodable": 1}
    assert scale.load_stats(out).n_prompts == 2
    lines = tmp_path / "c.jsonl"
    lines.write_text('{"text": "a = 1"}\n{"text": "b \\ud800 c"}\n')
    with pytest.raises(
        TLDynamicsError,
        match=r"c.jsonl:2: not valid UTF-8 text \(or a lone "
        "surrogate\\)",
    ):
        run(model, lines)
    with pytest.raises(TLDynamicsError, match="prompt 1: not valid UTF-8"):
        run(model, ["a = 1", "b \ud800"])
    code, _, err = main(
        capsys,
        "stats",
        "--model",
        NAME,
        "--prompts",
        str(raw),
        "--out",
        str(tmp_path / "cli.safetensors"),
        "--no-progress",
    )
    assert code == 2 and "raw.txt:2: not valid UTF-8" in err and "Traceback" not in err
    code, out, _ = main(
        capsys,
        "stats",
        "--model",
        NAME,
        "--prompts",
        str(raw),
        "--out",
        str(tmp_path / "cli.safetensors"),
        "--no-progress",
        "--on-long",
        "skip",
    )
    assert code == 0 and "2 prompts" in out
    assert scale.load_stats(tmp_path / "cli.safetensors").skipped == {"skipped_undecodable": 1}


# ---------------------------------------------------------------------- 5. crafted headers
def _parts(path_or_bytes):
    data = path_or_bytes if isinstance(path_or_bytes, bytes) else Path(path_or_bytes).read_bytes()
    from safetensors.numpy import load

    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + n])["__metadata__"]
    return load(data), meta


def _repack(tensors, meta, header_text=None, checksum=True):
    meta = dict(meta)
    if header_text is not None:
        meta[_format.HEADER_KEY] = header_text
    if checksum:
        meta[_format.CHECKSUM_KEY] = _format._checksum(tensors, meta[_format.HEADER_KEY])
    return _format._pack(tensors, meta)


def _with_header(path, edit):
    tensors, meta = _parts(path)
    header = json.loads(meta[_format.HEADER_KEY])
    edit(header)
    return _repack(tensors, meta, json.dumps(header, allow_nan=True))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda h: h.update(n_prompts=float("inf")), "not valid JSON"),
        (lambda h: h.update(n_prompts=[6]), "n_prompts must be an integer"),
        (lambda h: h.update(n_prompts=-6), "n_prompts must be an integer in 0.."),
        (lambda h: h.update(analyses=["odds_ratio", "trajectories", "heads"]), "analyses"),
        (
            lambda h: h["odds_ratio"].update(layers=[0]),
            "odds_ratio.scale has 2 entries for 1 layers",
        ),
        (lambda h: h["odds_ratio"].update(heads=[0, 1]), "has shape \\[.*\\]; the header implies"),
        (lambda h: h["trajectories"]["meta"].update(d_model=32), "state_sum.limbs has shape"),
        (lambda h: h["settings"].update(batch_size=0), "settings.batch_size must be an integer"),
        (lambda h: h.update(extra=1), "unknown \\['extra'\\]"),
    ],
)
def test_crafted_headers_with_a_recomputed_checksum_are_refused(
    stats_file, tmp_path, edit, message
):
    path = tmp_path / "crafted.safetensors"
    path.write_bytes(_with_header(stats_file, edit))
    with pytest.raises(TLDynamicsError, match=message):
        scale.load_stats(path)


def test_crafted_tensors_are_refused(stats_file, tmp_path):
    tensors, meta = _parts(stats_file)
    cases = {
        "outside float64's range": {"odds_ratio.sums.exponent": np.array([1 << 62])},
        "holds negative counts": {"trajectories.ints.n_tokens": np.array(-5)},
        "not described by the header": {"extra": np.zeros(2, dtype=np.int64)},
    }
    for message, change in cases.items():
        path = tmp_path / "t.safetensors"
        path.write_bytes(_repack({**tensors, **change}, meta))
        with pytest.raises(TLDynamicsError, match=message):
            scale.load_stats(path)


def test_partial_files_need_asking_and_merging_a_file_with_itself_is_refused(
    model, stats_file, tmp_path, capsys
):
    out = tmp_path / "p.safetensors"
    run(model, CORPUS, out, max_batches=1)
    partial = tmp_path / "p.safetensors.partial"
    with pytest.raises(TLDynamicsError, match="checkpoint of an unfinished run"):
        scale.load_stats(partial)
    page = tmp_path / "p.html"
    code, _, err = main(capsys, "report", "--stats", str(partial), "--out", str(page))
    assert code == 2 and "--allow-partial" in err and not page.exists()
    assert (
        main(capsys, "report", "--stats", str(partial), "--out", str(page), "--allow-partial")[0]
        == 0
    )
    with pytest.raises(TLDynamicsError, match="items 0 and 1 hold the same prompts"):
        scale.merge_stats(stats_file, stats_file)
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(stats_file.read_bytes())
    with pytest.raises(TLDynamicsError, match="would count every prompt twice"):
        scale.merge_stats(stats_file, copy)


# ---------------------------------------------------------------------- 10. fuzz
_BAD = {
    int: ["x", 1.5, -1, True],
    float: ["x", -1.0, float("inf"), float("nan"), True],
    str: [5, [], None, True],
    bool: [5, "x", None],
    type(None): ["x", -1, True, {}],
    list: ["x", {}, 5, []],
    dict: ["x", [], 5],
}


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _mutate_header(header, rng):
    """One change that makes the header invalid whatever the field (or, for a few, leaves the
    content equal: a reordering)."""
    path = rng.choice([p for p in _paths(header) if p])
    parent = header
    for key in path[:-1]:
        parent = parent[key]
    key, value = path[-1], parent[path[-1]]
    kind = rng.random()
    if kind < 0.15 and isinstance(parent, dict):
        del parent[key]
    elif kind < 0.25 and isinstance(parent, dict):
        parent[f"bogus_{rng.randrange(9)}"] = 0
    elif kind < 0.35 and isinstance(value, list) and value:
        value.append(value[0] if rng.random() < 0.5 else "x")
    elif kind < 0.45 and isinstance(value, list) and len(value) > 1:
        del value[rng.randrange(len(value))]
    else:
        parent[key] = rng.choice(_BAD[type(value)])


def _mutate_tensors(tensors, rng):
    name = rng.choice(sorted(tensors))
    array = tensors[name]
    kind = rng.randrange(7)
    if kind == 0:
        del tensors[name]
    elif kind == 1:
        tensors[f"{name}_extra"] = array
    elif kind == 2:
        tensors[name] = array.astype(np.uint8)
    elif kind == 3:
        tensors[name] = array.reshape(array.shape + (1,))
    elif kind == 4:
        tensors[name] = (
            np.concatenate([array.reshape(-1), array.reshape(-1)[:1]])
            if array.size
            else np.zeros(1, dtype=np.int64)
        )
    elif name.endswith("exponent"):
        tensors[name] = np.array([rng.choice([1 << 62, -(1 << 62), 1 << 20, int(array[0]) + 1])])
    elif name.endswith("limbs"):
        tensors[name] = array[:0]
    else:
        changed = array.copy().reshape(-1)
        changed[rng.randrange(max(changed.size, 1))] = -rng.randrange(1, 1 << 40)
        tensors[name] = changed.reshape(array.shape)


def test_fuzz_mutated_statistics_files_load_equal_or_raise_tldynamicserror(model, tmp_path):
    whole = run(model, CORPUS[:6])
    partial = run(model, CORPUS[:6], tmp_path / "x.safetensors", max_batches=1)
    bases = [_format.to_bytes(whole), _format.to_bytes(partial, {"next_batch": 1})]
    rng = random.Random(24)
    outcomes = {"equal": 0, "refused": 0}
    for i in range(2400):
        original = bases[i % 2]
        tensors, meta = _parts(original)
        kind = i % 4
        if kind == 0:  # header field, checksum recomputed
            header = json.loads(meta[_format.HEADER_KEY])
            _mutate_header(header, rng)
            data = _repack(tensors, meta, json.dumps(header, allow_nan=True))
        elif kind == 1:  # tensor, checksum recomputed
            _mutate_tensors(tensors, rng)
            data = _repack(tensors, meta)
        elif kind == 2:  # raw bytes: flips, cuts, insertions anywhere
            data = bytearray(original)
            at = rng.randrange(len(data))
            choice = rng.randrange(3)
            if choice == 0:
                data[at] ^= 1 << rng.randrange(8)
            elif choice == 1:
                del data[at:]
            else:
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
            data = bytes(data)
        else:  # the metadata itself: the checkpoint position, unknown keys, the checksum
            meta = dict(meta)
            target = rng.choice([_format.CHECKPOINT_KEY, "bogus", _format.CHECKSUM_KEY])
            meta[target] = rng.choice(
                [
                    '{"next_batch": -1}',
                    '{"next_batch": "1"}',
                    "[]",
                    '{"next_batch": 1, "x": 2}',
                    "nope",
                    "0" * 64,
                ]
            )
            data = _repack(tensors, meta, checksum=target != _format.CHECKSUM_KEY)
        path = tmp_path / "fuzz.safetensors"
        path.write_bytes(data)
        allow = i % 2 == 1
        try:
            loaded = scale.load_stats(path, allow_partial=allow)
        except TLDynamicsError:
            outcomes["refused"] += 1
            continue
        except Exception as exc:  # a raw exception: the defect this test exists for
            pytest.fail(f"mutation {i} (kind {kind}) raised {type(exc).__name__}: {exc}")
        expected = whole if i % 2 == 0 else partial
        assert _format.to_bytes(loaded) == _format.to_bytes(expected), (
            f"mutation {i} (kind {kind}) was silently accepted"
        )
        outcomes["equal"] += 1
    assert sum(outcomes.values()) == 2400 and outcomes["refused"] > 2000, outcomes


# ---------------------------------------------------------------------- 9. every model shape
def _gpt2(tmp_path, n_layer, n_head, n_embd):
    import transformers

    from tl_dynamics import compat

    tok = testing.tokenizer()
    config = transformers.GPT2Config(
        vocab_size=len(tok),
        bos_token_id=0,
        eos_token_id=0,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        n_positions=64,
    )
    torch.manual_seed(0)
    folder = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return compat.bridge_class().boot_transformers(str(folder), device="cpu").eval()


@pytest.mark.parametrize(
    "shape, prompt",
    [
        ((1, 4, 16), "def f(x): return x + 1"),  # one layer
        ((2, 1, 16), "def f(x): return x + 1"),  # one head
        ((2, 4, 4), "def f(x): return x + 1"),  # d_head 1
        ((2, 4, 16), "x"),  # a one-token prompt
    ],
    ids=["1-layer", "1-head", "d_head-1", "1-token"],
)
def test_every_model_shape_builds_the_full_report(tmp_path, shape, prompt):
    from tl_dynamics import report

    page = report.build_report(_gpt2(tmp_path, *shape), prompt, "tiny", threads=1)
    assert page.failed_sections == []
    html = page.to_html()
    assert "This section failed" not in html and len(page.sections) == 1 + len(report.SECTIONS)


def test_empty_and_one_cell_maps_have_a_size():
    from tl_dynamics.viz import _specs

    for values in (np.zeros((0, 3)), np.zeros((1, 1)), np.zeros((0, 0))):
        spec, height = _specs.canvas_spec("Heatmap", {"values": values})
        assert spec["kind"] == "heatmap" and height >= 140
    spec, height = _specs.canvas_spec(
        "AttentionGrid", {"thumbs": np.zeros((0, 2, 2)), "full": {}, "tokens": ["a", "b"]}
    )
    assert spec["names"] == [] and height == 700


# ---------------------------------------------------------------------- 7. heads in chunks
def test_atlas_runs_the_probes_in_chunks_with_the_same_numbers(monkeypatch):
    from tl_dynamics import atlas
    from tl_dynamics.atlas import _measure

    model = testing.cached_model("gpt2")
    whole = atlas.compute(model, n_seq=7, seq_len=6)
    rows = []
    original = ModelAdapter.forward

    def counting(self, batch, *a, **k):
        rows.append(int(self.tokenize(batch).tokens.shape[0]))
        return original(self, batch, *a, **k)

    monkeypatch.setattr(ModelAdapter, "forward", counting)
    monkeypatch.setattr(_measure, "PROBE_CHUNK", 3)
    chunked = atlas.compute(model, n_seq=7, seq_len=6)
    # every forward pass holds at most 3 probes (times the causal variants of one layer's
    # heads), whatever n_seq is: memory is flat in n_seq
    variants = 3 * model.cfg.n_heads
    assert rows and max(rows) <= 3 * variants and 7 not in rows
    for key, value in whole.scores.items():
        np.testing.assert_allclose(chunked.scores[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    for key, value in whole.delta_loss.items():
        np.testing.assert_allclose(
            chunked.delta_loss[key], value, rtol=1e-4, atol=1e-5, err_msg=key
        )
    assert {k: r.roles for k, r in chunked.roles.items()} == {
        k: r.roles for k, r in whole.roles.items()
    }


def test_a_crafted_contextual_mlp_description_names_only_known_classes(tmp_path):
    from safetensors.torch import save_file

    def craft(tree):
        path = tmp_path / "mlp.safetensors"
        text = tree if isinstance(tree, str) else json.dumps(tree)
        save_file(
            {"t": torch.zeros(2)},
            str(path),
            metadata={
                "tl_dynamics.contextual_mlp": f'{{"format": "{SAVE_FORMAT}", "tree": {text}}}'
            },
        )
        return path

    cases = [
        ({"type": "os.system", "fields": {}}, "unknown type 'os.system'"),
        ({"type": "ContextualMLP", "fields": {"layer": 0, "evil": 1}}, "has no fields"),
        ({"type": "ContextualMLP", "fields": {"layer": 0}}, "fields do not fit"),
        ({"tensor": "missing"}, "tensor 'missing' is missing"),
        ({"tuple": [{"tuple": []}] * 2, "x": 1}, "malformed entry"),
        ('{"tuple": ' * 3000 + "[]" + "}" * 3000, "not a saved ContextualMLP|nested too deeply"),
        ("[" * 100000 + "]" * 100000, "not a saved ContextualMLP"),
    ]
    for tree, message in cases:
        with pytest.raises(TLDynamicsError, match=message):
            cm.ContextualMLP.load(craft(tree))


def test_a_missing_output_folder_is_refused_and_nothing_is_created(tmp_path, capsys):
    """A typo in a folder name is an error before any work, naming the first missing folder,
    and no folder is created (issue 24: refuse a missing directory)."""
    out = tmp_path / "reprots" / "sub" / "page.html"
    with pytest.raises(TLDynamicsError, match=r"the folder .*reprots does not exist"):
        files.check_output(out, example="page.html")
    code = cli.main(
        ["report", "--model", "tiny-random:gpt2", "--prompt", "a = 1", "--out", str(out)]
    )
    assert code != 0 and "reprots does not exist" in capsys.readouterr().err
    assert not (tmp_path / "reprots").exists()
