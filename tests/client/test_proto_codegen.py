"""The checked-in generated code must be what scripts/gen_proto.py makes from proto/ today."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "client" / "gpt2serve_client" / "_proto"


def test_generated_code_is_fresh(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    fresh = {p.name: p.read_text() for p in tmp_path.iterdir() if p.is_file()}
    checked_in = {p.name: p.read_text() for p in GENERATED.iterdir() if p.is_file()}
    assert fresh.keys() == checked_in.keys()
    stale = [name for name in fresh if fresh[name] != checked_in[name]]
    assert not stale, f"stale generated code {stale}: run `make proto`"


def test_client_imports_neither_torch_nor_transformers():
    code = ("import sys, gpt2serve_client; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
