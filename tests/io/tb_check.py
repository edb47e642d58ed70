#!/usr/bin/env python3
"""Reads a folder of Primus TensorBoard event files with TensorBoard's own EventAccumulator and
prints every scalar; with --expect, compares them with a JSON list of {tag, step, value} and
exits 1 on any difference.

    python3 tests/io/tb_check.py build/tests/io/tb_sample --expect build/tests/io/tb_sample/expected.json

The sample folder is written by the test TensorBoard.WritesSampleForTensorBoardCheck (test_io).
Needs the `tensorboard` Python package (present on the GPU machine, not in the build image).
"""
import argparse
import json
import struct
import sys

from tensorboard.backend.event_processing import event_accumulator


def f32(x):
    """The value as the float32 it was stored as."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logdir", help="folder holding events.out.tfevents.* files")
    ap.add_argument("--expect", help="JSON list of {tag, step, value} the run must hold exactly")
    args = ap.parse_args()

    # size_guidance 0: keep every event (the default samples scalars down to 10000 per tag).
    acc = event_accumulator.EventAccumulator(args.logdir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    got = {}
    for tag in sorted(acc.Tags()["scalars"]):
        for ev in acc.Scalars(tag):
            print(f"{tag}\tstep={ev.step}\tvalue={ev.value!r}\twall_time={ev.wall_time:.3f}")
            got[(tag, ev.step)] = ev.value
    print(f"{len(got)} scalars in {len(acc.Tags()['scalars'])} tags")

    if not args.expect:
        return 0 if got else 1
    with open(args.expect) as f:
        expected = {(e["tag"], e["step"]): e["value"] for e in json.load(f)}
    bad = 0
    for key, value in sorted(expected.items()):
        if key not in got:
            print(f"MISSING {key}")
            bad += 1
        elif f32(got[key]) != f32(value):
            print(f"DIFFERENT {key}: file {got[key]!r}, expected {value!r}")
            bad += 1
    for key in sorted(set(got) - set(expected)):
        print(f"UNEXPECTED {key}")
        bad += 1
    print("OK: every expected scalar matches" if bad == 0 else f"FAILED: {bad} differences")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
