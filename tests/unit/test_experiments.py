"""Every shipped experiment and every study's spec loads and validates; compose.yaml passes every knob with a default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from harness.spec.points import load_spec
from wiiide.config import RunConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted((REPO_ROOT / "experiments").glob("*.yaml"))
STUDIES = sorted((REPO_ROOT / "studies").glob("*/*.yaml"))


@pytest.mark.parametrize("path", EXPERIMENTS + STUDIES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_spec_loads(path):
    spec = load_spec(path)
    assert spec.points, path
    assert all(isinstance(p.config, RunConfig) for p in spec.points)


def test_every_study_notes_what_it_found_and_how_to_reproduce_it():
    folders = sorted(p for p in (REPO_ROOT / "studies").iterdir() if p.is_dir())
    assert folders
    for folder in folders:
        note = (folder / "NOTE.md").read_text()
        assert "**Found" in note and "**Reproduce" in note, folder.name
        commands = [line for line in note.splitlines() if line.startswith(("python -m harness", "wiiide-lab"))]
        assert commands, folder.name
        named = [word for c in commands for word in c.split() if word.endswith(".yaml")]
        assert [w for w in named if not (REPO_ROOT / w).is_file()] == [], folder.name
        for spec in folder.glob("*.yaml"):  # the note says what each of its specs found
            assert spec.name in note, spec


def test_every_experiment_says_what_it_shows_and_how_long_it_takes():
    for path in EXPERIMENTS:
        shows, takes = path.read_text().splitlines()[:2]
        assert shows.startswith("# Shows: ") and takes.startswith("# Takes: about "), path.name


def test_seed_studies_sweep_what_the_seeds_swept():
    buffers = load_spec(REPO_ROOT / "experiments/seed-buffers.yaml")
    sizes = [2**20, 4 * 2**20, 8 * 2**20, 16 * 2**20]
    links = sorted({p.params["link"] for p in buffers.points})
    assert links == ["gbit-rtt10ms", "gbit-rtt25ms", "gbit-rtt50ms", "none"]
    for link in links:  # the seeds' four sizes on every link, unshaped as the seeds ran them and with delay
        assert [p.config.sndbuf_bytes for p in buffers.points if p.params["link"] == link] == sizes, link
    assert all(p.config.rcvbuf_bytes == p.config.sndbuf_bytes for p in buffers.points)
    compression = load_spec(REPO_ROOT / "experiments/seed-compression.yaml")
    assert [p.config.compression for p in compression.points] == ["none", "zlib-1", "zlib-9", "adaptive"]
    logging = load_spec(REPO_ROOT / "experiments/seed-logging.yaml")
    assert [p.config.log_tier for p in logging.points] == ["verbose", "normal", "silent"]


def test_quick_is_small():
    quick = load_spec(REPO_ROOT / "experiments/quick.yaml")
    total_s = sum(p.config.duration_s for p in quick.points) * quick.repeats
    assert total_s <= 60 and all(p.config.num_workers == 4 for p in quick.points)


def test_quick_sets_the_default_placement_against_central_and_ddp_on_a_shaped_link():
    quick = load_spec(REPO_ROOT / "experiments/quick.yaml")
    shown = {(p.params["link"], p.params["engine"]): (p.config.engine, p.config.ps_shards) for p in quick.points}
    default_shards = RunConfig.model_fields["ps_shards"].default
    for link in ("rate-100m", "none"):
        assert shown[(link, "central")] == ("wiiide", "1")
        assert shown[(link, "sharded")] == ("wiiide", default_shards) and default_shards == "all"
        assert shown[(link, "ddp")][0] == "ddp"
    assert len(shown) == len(quick.points) == 6


def test_compose_passes_every_knob_with_its_default():
    text = (REPO_ROOT / "compose.yaml").read_text()
    compose = yaml.safe_load(text)
    per_service = {"WIIIIIDE_COORDINATOR_HOST", "WIIIIIDE_BIND_HOST", "WIIIIIDE_METRICS_DIR",
                   "WIIIIIDE_READY_FILE", "WIIIIIDE_NODE_ID"}
    defaults = RunConfig().to_env()
    worker_env = compose["services"]["worker"]["environment"]
    for key, value in defaults.items():
        if key in per_service:
            continue
        assert key in worker_env, key
        # ${VAR:-default}, or ${VAR-default} where an empty value is a choice of its own (shard_tcp_congestion)
        match = re.fullmatch(r"\$\{" + key + r":?-(.*)\}", str(worker_env[key]))
        assert match and match.group(1) == value, (key, worker_env[key])
    coordinator = compose["services"]["coordinator"]
    assert coordinator["cap_add"] == ["NET_ADMIN"] and "healthcheck" in coordinator
    assert compose["services"]["worker"]["depends_on"]["coordinator"]["condition"] == "service_healthy"
