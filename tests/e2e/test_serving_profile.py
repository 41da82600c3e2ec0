"""benchmarks/serving_profile.py (bench_http_serving.py --profile): py-spy attached to a
live process with the server's thread names, its samples read back and classified."""

import importlib.util
import pathlib
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("serving_profile", REPO / "benchmarks" / "serving_profile.py")
serving_profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serving_profile)

# An "engine thread" busy in a function named like the output processor's, and a
# main thread asleep on a condition: what each recorder must see.
TARGET = """
import threading, time
def finish_step():
    while True:
        sum(range(1000))
threading.Thread(target=finish_step, name="jpaged-engine", daemon=True).start()
threading.Condition().acquire()
time.sleep(30)
"""


@pytest.mark.skipif(not pathlib.Path(sys.executable).with_name("py-spy").exists(), reason="py-spy not installed")
def test_recording_classifies_each_threads_samples(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", TARGET])
    try:
        time.sleep(1.0)
        recording = serving_profile.Recording(proc.pid, tmp_path, "t", rate=100)
        time.sleep(1.5)
        paths = recording.stop()
    finally:
        proc.kill()
        proc.wait()
    rows = {(r["thread"], r["what"]): r for r in serving_profile.summarize(paths, "t")}
    engine = rows[("engine thread", "output processing")]
    assert engine["pct_of_thread"] == pytest.approx(100.0)
    assert engine["pct_of_gil_samples"] > 80  # the busy thread holds the GIL, the sleeper never
    assert rows[("event loop thread", "other")]["pct_of_gil_samples"] < 20
    assert 50 < rows[("GIL", "held by any thread")]["pct_of_thread"] <= 100


def test_classify_takes_the_innermost_matching_frame():
    frames = ["_run (jpaged/engine/async_engine.py:1)", "step (jpaged/engine/core.py:2)",
              "finish_step (jpaged/engine/core.py:3)", "take (jpaged/engine/detokenizer.py:4)"]
    assert serving_profile.classify(frames, serving_profile.ENGINE_RULES) == "detokenizing"
    assert serving_profile.classify(frames[:3], serving_profile.ENGINE_RULES) == "output processing"
    assert serving_profile.classify(["main (x.py:1)"], serving_profile.ENGINE_RULES) == "other"
