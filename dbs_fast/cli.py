"""`dbs-fast` command line: export, generate, bench, eval. Bad input -> message + exit 2."""
from __future__ import annotations

import argparse
import json
import sys

from .errors import DBSError


def _add_export(sub):
    p = sub.add_parser("export", help="Hugging Face checkpoint -> ONNX with KV cache + manifest")
    p.add_argument("--model", required=True, help="hub id, local checkpoint dir, or `default`")
    p.add_argument("--out", required=True, help="output directory (refused if it exists, unless --force)")
    p.add_argument("--optimize", action="store_true", help="onnxruntime transformer graph fusions")
    p.add_argument("--quantize", choices=["int8"], help="dynamic int8 weights")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_run_export)


def _run_export(a) -> int:
    try:
        from .export.convert import export_model
    except ImportError as e:
        raise DBSError(f"export needs the export extra (`pip install 'dbs-fast[export]'`): {e}") from None
    m = export_model(a.model, a.out, optimize=a.optimize, quantize=a.quantize, force=a.force, quiet=a.quiet)
    print(json.dumps({k: m[k] for k in ("source", "architecture", "dtype", "steps", "parity")}, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dbs-fast", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    _add_export(sub)
    try:
        from . import cli_generate
        cli_generate.add_commands(sub)
    except ImportError:
        pass
    return ap



def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)  # argparse itself exits 2 on malformed flags
    try:
        return a.func(a) or 0
    except DBSError as e:
        print(f"dbs-fast {a.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
