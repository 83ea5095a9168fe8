"""Write the embedded tiny Qwen3 checkpoint (HF format) to a directory. Same bytes on every build."""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's lessons/ and shared/, not an installed course's
from shared.tiny_qwen3 import build_tiny_qwen3, checkpoint_digest  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, type=Path, help="directory to write (created if missing)")
    args = p.parse_args()
    if args.out.exists() and not args.out.is_dir():
        print(f"error: --out {args.out} exists and is not a directory", file=sys.stderr)
        return 2
    build_tiny_qwen3(args.out)
    print(f"wrote {args.out} (sha256 of all files: {checkpoint_digest(args.out)[:16]}...)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
