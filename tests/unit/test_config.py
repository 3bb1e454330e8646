"""wiiide.config: defaults, environment round trip, parsing and validation errors that name the field."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from wiiide.config import COMPRESSION_CHOICES, ENV_PREFIX, RunConfig, default_config
from wiiide.errors import ConfigError

MIB = 1024 * 1024
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_valid_and_as_documented():
    cfg = RunConfig()
    assert cfg == default_config()
    assert cfg.sndbuf_bytes == cfg.rcvbuf_bytes == 8 * MIB
    assert cfg.recv_chunk_bytes == 64 * 1024 * 1024
    assert cfg.tcp_nodelay is True and cfg.tcp_quickack is True
    assert cfg.compression == "none" and cfg.log_tier == "normal"
    assert cfg.hidden_sizes == (64,)
    assert RunConfig.from_dict({}) == cfg
    assert RunConfig.from_env({}) == cfg


def test_compression_choices():
    assert set(COMPRESSION_CHOICES) == {"none", "adaptive", *(f"zlib-{n}" for n in range(1, 10))}


def test_to_env_from_env_roundtrip_defaults():
    cfg = RunConfig()
    env = cfg.to_env()
    assert set(env) == {ENV_PREFIX + f.upper() for f in RunConfig.field_names()}
    assert all(isinstance(v, str) for v in env.values())
    assert RunConfig.from_env(env) == cfg


def test_to_env_from_env_roundtrip_non_defaults():
    fields = dict(
        coordinator_host="10.0.0.2", bind_host="0.0.0.0", port=31000, num_workers=7, node_id="w-3",
        dataset="synthetic", synthetic_samples=999, synthetic_features=33, synthetic_classes=4,
        test_fraction=0.25, hidden_sizes=(128, 64, 32), batch_size=17, learning_rate=0.0125, momentum=0.9,
        seed=42, torch_threads=0, duration_s=1.5, max_steps=12, sndbuf_bytes=0, rcvbuf_bytes=65536,
        tcp_nodelay=False, tcp_quickack=False, keepalive=False, recv_chunk_bytes=4096,
        max_frame_bytes=64 * 1024, compression="zlib-3", adaptive_threshold_bytes=0, log_tier="silent",
        log_every_steps=3, metrics_dir="/tmp/x y", ready_file="/tmp/ready", connect_timeout_s=0.5,
        io_timeout_s=2.25, codec_threads=3, codec_chunk_bytes=2 * 1024 * 1024, link_bandwidth_bps=100_000_000,
        allow_lossy=True, lossy_warmup_steps=7, topk_fraction=0.05, codec_probe_every=9,
    )
    cfg = RunConfig(**fields)
    # Every field set here differs from its default, so the round trip really carries each one.
    defaults = RunConfig()
    assert [f for f in fields if fields[f] == getattr(defaults, f)] == []
    env = cfg.to_env()
    assert env["WIIIIIDE_TCP_NODELAY"] == "0"
    assert env["WIIIIIDE_HIDDEN_SIZES"] == "128,64,32"
    assert env["WIIIIIDE_METRICS_DIR"] == "/tmp/x y"
    back = RunConfig.from_env(env)
    assert back == cfg
    assert all(getattr(back, f) == v for f, v in fields.items())


def test_from_env_ignores_unprefixed_and_shell_variables():
    env = {"PATH": "/bin", "WIIIIIDE_IMAGE": "wiiide:dev", "WIIIIIDE_SECRET": "s", "WIIIIIDE_PORT": "29999"}
    assert RunConfig.from_env(env).port == 29999


def test_from_env_unknown_variable_is_an_error():
    with pytest.raises(ConfigError, match="sndbuf") as info:
        RunConfig.from_env({"WIIIIIDE_SNDBUF": "8MiB"})
    assert "sndbuf_bytes" in str(info.value)  # known keys are listed


def test_from_dict_unknown_keys_listed():
    with pytest.raises(ConfigError) as info:
        RunConfig.from_dict({"prot": 1, "zzz": 2, "port": 5})
    msg = str(info.value)
    assert "'prot'" in msg and "'zzz'" in msg
    assert "port" in msg  # the known keys are listed too


@pytest.mark.parametrize("text, expected", [
    ("8388608", 8 * MIB), ("8MiB", 8 * MIB), ("8mib", 8 * MIB), ("8M", 8 * MIB), ("256k", 262_144),
    ("256KiB", 256 * 1024), (" 64 k ", 64 * 1024), ("1G", 1024 * MIB), ("1gib", 1024 * MIB),
    # wiiide.units reads every size: KB/MB are IEC too (as Docker reads mem_limit), fractions of whole bytes
    ("8MB", 8 * MIB), ("1.5M", 1_572_864), ("4.5k", 4608),
])
def test_size_suffixes(text, expected):
    assert RunConfig.from_dict({"sndbuf_bytes": text}).sndbuf_bytes == expected
    assert RunConfig.from_env({"WIIIIIDE_RCVBUF_BYTES": text}).rcvbuf_bytes == expected


@pytest.mark.parametrize("text", ["8 MiBs", "-4096", "0x1000", "", "eight", "4096.5", "8mbit", True, -1])
def test_bad_sizes(text):
    with pytest.raises(ConfigError, match="sndbuf_bytes") as info:
        RunConfig.from_dict({"sndbuf_bytes": text})
    assert "allowed: 0 (kernel default) or 4096..1 GiB" in str(info.value)


@pytest.mark.parametrize("text, expected", [
    ("1", True), ("true", True), ("TRUE", True), ("yes", True), ("on", True), (" On ", True),
    ("0", False), ("false", False), ("False", False), ("no", False), ("off", False),
    (True, True), (False, False),
])
def test_bool_parsing(text, expected):
    assert RunConfig.from_dict({"tcp_nodelay": text}).tcp_nodelay is expected


@pytest.mark.parametrize("text", ["2", "maybe", "", "y", "nope", 1.5])
def test_bad_bool(text):
    with pytest.raises(ConfigError, match="tcp_nodelay"):
        RunConfig.from_dict({"tcp_nodelay": text})


@pytest.mark.parametrize("value, expected", [
    ("64,32", (64, 32)), ("64, 32", (64, 32)), ("64 32", (64, 32)), ("128", (128,)), ([8, 4], (8, 4)),
    ((16,), (16,)), (32, (32,)),
])
def test_hidden_sizes_parsing(value, expected):
    assert RunConfig.from_dict({"hidden_sizes": value}).hidden_sizes == expected


@pytest.mark.parametrize("value", ["", "64,x", "0", "64,-1", [], [70000], "1," * 17, True])
def test_bad_hidden_sizes(value):
    with pytest.raises(ConfigError, match="hidden_sizes"):
        RunConfig.from_dict({"hidden_sizes": value})


def test_int_field_from_float_and_bool():
    assert RunConfig.from_dict({"port": 4096.0}).port == 4096
    with pytest.raises(ConfigError, match="port"):
        RunConfig.from_dict({"port": 4096.5})
    with pytest.raises(ConfigError, match="port"):
        RunConfig.from_dict({"port": True})
    with pytest.raises(ConfigError, match="learning_rate"):
        RunConfig.from_dict({"learning_rate": True})
    with pytest.raises(ConfigError, match="node_id"):
        RunConfig.from_dict({"node_id": ["a"]})


BAD_VALUES = [
    ("port", 0), ("port", 65536), ("num_workers", 0), ("num_workers", 257), ("dataset", "mnist"),
    ("synthetic_samples", 19), ("synthetic_features", 0), ("synthetic_classes", 1), ("test_fraction", 0.0),
    ("test_fraction", 1.0), ("test_fraction", float("nan")), ("batch_size", 0), ("learning_rate", 0.0),
    ("learning_rate", 101.0), ("lr_schedule", "step"), ("lr_schedule", "cosine"),  # cosine: needs a decay length
    ("lr_warmup_steps", -1), ("lr_decay_steps", -1), ("lr_decay_steps", 5),  # 5: needs lr_schedule linear/cosine
    ("lr_min_ratio", 1.5), ("lr_min_ratio", 0.5),  # 0.5: needs lr_schedule linear/cosine
    ("momentum", 1.0), ("momentum", -0.1), ("torch_threads", -1),
    ("torch_threads", 257), ("duration_s", 0.0), ("duration_s", float("nan")), ("max_steps", -1),
    ("sndbuf_bytes", 100), ("sndbuf_bytes", 4095), ("rcvbuf_bytes", 100), ("rcvbuf_bytes", 2 * 1024 * MIB),
    ("recv_chunk_bytes", 1023), ("recv_chunk_bytes", 0), ("max_frame_bytes", 1000), ("compression", "zlib-0"),
    ("compression", "lz4"), ("adaptive_threshold_bytes", -1), ("log_tier", "loud"), ("log_every_steps", 0), ("trace_steps", -1), ("trace_steps", 1001),
    ("compression", "fixed:brotli"), ("compression", "fixed:topk-0"), ("codec_threads", -1), ("codec_threads", 65),
    ("codec_chunk_bytes", 1024), ("link_bandwidth_bps", -1), ("lossy_warmup_steps", -1), ("topk_fraction", 0.0),
    ("topk_fraction", 1.5), ("codec_probe_every", 1),
    ("connect_timeout_s", 0.0), ("io_timeout_s", -1.0), ("hidden_sizes", ()),
    ("partition_balance", "flows"), ("partition_placement", "striped"), ("tcp_congestion", "cu bic"), ("shard_tcp_congestion", "re no"), ("tcp_congestion", "x" * 16),
    ("warmup_steps", -1), ("warmup_steps", 100_001), ("engine", "horovod"), ("ddp_comm_hook", "int8"),
    ("ddp_comm_hook", "fp16"),  # needs engine ddp
    ("ddp_find_unused_parameters", True), ("ddp_find_unused_parameters", "maybe"),  # True: needs engine ddp
    ("powersgd_rank", 0), ("powersgd_rank", 2),  # 2: needs ddp_comm_hook powersgd
    ("fsdp_reshard_after_forward", False),  # needs engine fsdp
    ("grad_accum_steps", 0), ("grad_accum_steps", 33),  # 33: more micro-batches than batch_size (32) samples
    ("staleness_bound", -1), ("staleness_bound", "never"), ("local_steps", 0), ("local_steps", 1025),
    ("outer_optimizer", "nesterov"),  # needs local_steps > 1
    ("staleness_scaling", "inverse"),  # needs staleness_bound != 0
    ("ssp_cache", True),  # needs staleness_bound s >= 1 (not 0, not async) and local_steps 1
    ("outer_learning_rate", 0.0), ("outer_momentum", 1.0), ("adaptive_batch", "maybe"), ("adaptive_smoothing", 0.0),
    ("adaptive_clock_gain", -0.5), ("adaptive_clock_gain", 5),
    ("debug_step_sleep_s", -1.0), ("debug_sleep_worker_rank", -1),
    ("mixed_precision", "fp8"), ("activation_checkpointing", True),  # True: needs model transformer
    ("profile", True),  # needs engine ddp or fsdp
    ("heartbeat_interval_s", 0.0), ("heartbeat_interval_s", 10.0), ("stall_timeout_s", -1.0), ("stall_timeout_s", 1e9),  # not below io_timeout_s (10 s)
    ("handshake_timeout_s", 0.0), ("handshake_timeout_s", 301.0), ("max_handshakes", 0), ("max_handshakes", 1025),
    ("eval_every_s", -1.0), ("eval_every_s", float("nan")), ("target_accuracy", 1.5),
    ("target_accuracy", 0.9), ("target_loss", -1.0), ("target_loss", 2.0),  # 0.9, 2.0: need eval_every_s
    ("stop_at_target", True), ("stop_at_target", "maybe"),  # True: needs a target
    ("ps_shards", "0"), ("ps_shards", "some"), ("ps_shards", 4),  # 4: more than the 3 nodes of 2 workers
    ("partition_bytes", 2), ("partitions_per_shard", 0), ("partitions_per_shard", 257),
    ("partitions_per_shard", "some"), ("piece_link_s", -0.001), ("shard_port", 65536), ("batch_handout", "files"), ("push_schedule", "fifo"),
    ("tls", "maybe"),
    ("model", "rnn"), ("cnn_channels", 0), ("transformer_layers", 0), ("transformer_layers", 49),
    ("transformer_width", 4), ("transformer_width", 130),  # 130: not a multiple of the 4 heads
    ("transformer_heads", 0), ("transformer_context", 4), ("embedding_rows", 1), ("embedding_dim", 0),
    ("embedding_fields", 0), ("embedding_zipf_exponent", -0.5), ("embedding_samples", 10),
    ("sparse_embedding", True),  # needs model embedding
    ("checkpoint_every_steps", -1), ("checkpoint_every_s", -1.0), ("checkpoint_every_s", 86_401.0),
    ("checkpoint_keep", 1), ("checkpoint_keep", 101), ("rejoin_timeout_s", -1.0), ("rejoin_timeout_s", 86_401.0),
]


@pytest.mark.parametrize("field, value", BAD_VALUES, ids=[f"{f}={v!r}" for f, v in BAD_VALUES])
def test_validation_error_names_the_field(field, value):
    with pytest.raises(ConfigError) as info:
        RunConfig(**{field: value})
    msg = str(info.value)
    assert f"'{field}'" in msg
    assert "allowed" in msg or "needs" in msg  # what would be accepted
    with pytest.raises(ConfigError, match=field):
        RunConfig().replace(**{field: value})


def test_every_field_has_a_bad_value_test():
    tested = {f for f, _ in BAD_VALUES}
    unchecked = {"coordinator_host", "bind_host", "node_id", "seed", "metrics_dir", "ready_file", "start_gate_file",
                 "tcp_nodelay", "tcp_quickack", "keepalive", "allow_lossy",
                 "tls_ca_file", "checkpoint_dir", "tls_cert_file", "tls_key_file"}  # free strings / any int / booleans
    assert set(RunConfig.field_names()) - unchecked == tested


@pytest.mark.parametrize("changes, field", [
    ({"model": "embedding", "sparse_embedding": True, "engine": "fsdp"}, "sparse_embedding"),
    ({"model": "embedding", "sparse_embedding": True, "momentum": 0.9}, "sparse_embedding"),
    ({"model": "transformer", "transformer_width": 100, "transformer_heads": 8}, "transformer_width"),
])
def test_workload_rules_between_fields(changes, field):
    with pytest.raises(ConfigError, match=field):
        RunConfig(**changes)
    ok = RunConfig(model="embedding", sparse_embedding=True, engine="ddp", momentum=0.9)  # ddp: momentum is fine
    assert ok.sparse_embedding


def test_boundary_values_accepted():
    cfg = RunConfig(port=1, sndbuf_bytes=4096, rcvbuf_bytes=1024 * MIB, recv_chunk_bytes=1024,
                    max_frame_bytes=64 * 1024, num_workers=256, momentum=0.0, max_steps=0)
    assert cfg.sndbuf_bytes == 4096


@pytest.mark.parametrize("field", ["connect_timeout_s", "io_timeout_s"])
def test_non_finite_timeout_rejected(field):
    with pytest.raises(ConfigError, match=field):
        RunConfig(**{field: float("inf")})


def test_replace_validates_and_keeps_other_fields():
    cfg = RunConfig(port=30000).replace(num_workers="3", hidden_sizes="8,8")
    assert (cfg.port, cfg.num_workers, cfg.hidden_sizes) == (30000, 3, (8, 8))
    with pytest.raises(ConfigError, match="unknown"):
        cfg.replace(bogus=1)


def test_frozen():
    cfg = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del cfg.port
    assert cfg.port == 29500
    assert hash(cfg) == hash(RunConfig())  # immutable, so usable as a dict key as before


def test_to_dict_is_json_ready():
    import json

    d = RunConfig(hidden_sizes=(3, 2)).to_dict()
    assert d["hidden_sizes"] == [3, 2]
    assert json.loads(json.dumps(d)) == d


@pytest.mark.parametrize("env, args, needle", [
    ({"WIIIIIDE_SNDBUF_BYTES": "100"}, [], "sndbuf_bytes"),
    ({"WIIIIIDE_PORTT": "1"}, [], "portt"),
    ({}, ["--set", "port=0"], "port"),
    ({}, ["--set", "port"], "FIELD=VALUE"),
])
def test_cli_configuration_error_exits_2(env, args, needle):
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    full_env.update(env, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-m", "wiiide", "worker", *args], env=full_env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "configuration error" in proc.stderr and needle in proc.stderr
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------------------------------
# pydantic-settings: the WIIIIIDE_ prefix, errors that name the field and the range, sizes, schema
# --------------------------------------------------------------------------------------------------
def test_env_prefix_has_five_is_and_is_the_settings_prefix():
    assert ENV_PREFIX == "WIIIIIDE_" and ENV_PREFIX.count("I") == 5
    assert RunConfig.model_config["env_prefix"] == ENV_PREFIX
    cfg = RunConfig.from_env({"WIIIIIDE_NUM_WORKERS": "5", "WIIIIIDE_SNDBUF_BYTES": "256k",
                              "wiiiiide_batch_size": "7",  # names are case-insensitive
                              "WIIIDE_PORT": "1234", "WIIIIDE_PORT": "1234"})  # three or four I's: not ours
    assert (cfg.num_workers, cfg.sndbuf_bytes, cfg.batch_size, cfg.port) == (5, 262_144, 7, 29500)


def test_constructor_does_not_read_the_environment(monkeypatch):
    monkeypatch.setenv("WIIIIIDE_PORT", "31111")
    assert RunConfig().port == 29500  # the harness builds configs for other processes: its env must not leak
    assert RunConfig.from_env().port == 31111  # from_env reads os.environ when given nothing


@pytest.mark.parametrize("field, value, allowed", [
    ("port", 70000, "1..65535"),
    ("port", "70000", "1..65535"),
    ("test_fraction", 1.5, "0 < x < 1"),
    ("recv_chunk_bytes", "512", "1 KiB..256 MiB"),
    ("batch_size", "many", "1..65536"),
    ("dataset", "mnist", "digits | synthetic"),
    ("io_timeout_s", 1e9, "0 < x <= 86400 seconds"),
    ("hidden_sizes", [8, 0], "1..16 layer widths, each 1..65536"),
    ("hidden_sizes", "8,0", "1..16 layer widths, each 1..65536"),
])
def test_bad_value_error_names_the_field_the_value_and_the_allowed_range(field, value, allowed):
    """Strings go through the environment, other values through the constructor: the same message."""
    with pytest.raises(ConfigError) as info:
        if isinstance(value, str):
            RunConfig.from_env({ENV_PREFIX + field.upper(): value})
        else:
            RunConfig(**{field: value})
    msg = str(info.value)
    assert msg.startswith(f"config field '{field}': bad value ")
    assert repr(value) in msg  # the value as given
    assert msg.endswith(f"allowed: {allowed}")
    assert "\n" not in msg and "pydantic" not in msg  # one line, in the project's words


def test_config_error_is_not_a_pydantic_error():
    from pydantic import ValidationError

    with pytest.raises(ConfigError) as info:
        RunConfig(port=0)
    assert not isinstance(info.value, ValidationError)


def test_sizes_use_the_one_unit_parser():
    from wiiide.units import parse_size_bytes

    cfg = RunConfig.from_dict({"sndbuf_bytes": "256k", "rcvbuf_bytes": "8MiB", "recv_chunk_bytes": "64KiB",
                               "max_frame_bytes": "2g", "codec_chunk_bytes": "1m", "adaptive_threshold_bytes": "0"})
    assert cfg.sndbuf_bytes == 262_144 == parse_size_bytes("256k")
    assert (cfg.rcvbuf_bytes, cfg.recv_chunk_bytes, cfg.max_frame_bytes) == (8_388_608, 65_536, 2_147_483_648)
    assert (cfg.codec_chunk_bytes, cfg.adaptive_threshold_bytes) == (1_048_576, 0)
    import wiiide.config

    assert not hasattr(wiiide.config, "_parse_size") and not hasattr(wiiide.config, "_SIZE_RE")


def test_link_bandwidth_takes_bit_per_second_or_an_si_rate():
    assert RunConfig.from_dict({"link_bandwidth_bps": "100000000"}).link_bandwidth_bps == 100_000_000
    assert RunConfig.from_dict({"link_bandwidth_bps": "100mbit"}).link_bandwidth_bps == 100_000_000  # k = 1000
    with pytest.raises(ConfigError, match="link_bandwidth_bps.*bytes per second"):
        RunConfig.from_dict({"link_bandwidth_bps": "100mbps"})  # tc reads bps as bytes/s: refused


def test_counts_are_plain_integers():
    assert RunConfig.from_dict({"seed": "-3", "num_workers": " 4 "}).seed == -3
    for value in ("4k", "4.0", "0x4"):
        with pytest.raises(ConfigError, match="num_workers"):
            RunConfig.from_dict({"num_workers": value})


def test_json_schema_describes_every_field_with_defaults_and_bounds():
    import json

    schema = RunConfig.json_schema()
    json.dumps(schema)  # JSON-ready
    props = schema["properties"]
    assert set(props) == set(RunConfig.field_names())
    port, string = props["port"]["anyOf"]
    assert (port["type"], port["minimum"], port["maximum"], props["port"]["default"]) == ("integer", 1, 65535, 29500)
    assert string == {"type": "string"}  # "29500" from the environment or YAML is read too
    assert props["port"]["allowed"] == "1..65535"
    fraction = props["test_fraction"]["anyOf"][0]
    assert (fraction["exclusiveMinimum"], fraction["exclusiveMaximum"]) == (0, 1)
    widths = props["hidden_sizes"]["anyOf"][0]
    assert (widths["minItems"], widths["maxItems"], widths["items"]["maximum"]) == (1, 16, 65536)
    assert props["dataset"]["enum"] == ["digits", "synthetic"]
    assert props["engine"]["enum"] == ["wiiide", "ddp", "fsdp"]
    assert props["hidden_sizes"]["default"] == [64]
    assert props["sndbuf_bytes"]["default"] == 8 * MIB
    assert {"type": "string"} in props["sndbuf_bytes"]["anyOf"]  # sizes may be written "8MiB"
    assert props["sndbuf_bytes"]["allowed"] == "0 (kernel default) or 4096..1 GiB"
    assert all(props[name].get("description") for name in props)
    assert schema.get("additionalProperties") is False  # unknown keys are refused


def test_json_schema_accepts_what_from_dict_accepts():
    jsonschema = pytest.importorskip("jsonschema")
    schema = RunConfig.json_schema()
    good = {"port": 30000, "sndbuf_bytes": "256k", "hidden_sizes": [8, 4], "tcp_nodelay": "on"}
    jsonschema.validate(good, schema)
    RunConfig.from_dict(good)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"port": 0}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"prot": 1}, schema)


def test_every_field_has_a_known_group_and_every_group_has_fields():
    from wiiide.config import CONFIG_GROUPS

    props = RunConfig.json_schema()["properties"]
    ungrouped = sorted(name for name, prop in props.items() if prop.get("group") not in CONFIG_GROUPS)
    assert ungrouped == [], (f"fields without a group (declare them with _field after a _section(...) of "
                             f"wiiide.config.CONFIG_GROUPS): {ungrouped}")
    assert {prop["group"] for prop in props.values()} == set(CONFIG_GROUPS)
    assert (props["sndbuf_bytes"]["group"], props["compression"]["group"], props["tls"]["group"]) == \
        ("sockets", "codecs", "security")


def test_units_come_from_the_field_or_its_name():
    props = RunConfig.json_schema()["properties"]
    assert (props["sndbuf_bytes"]["unit"], props["duration_s"]["unit"], props["link_bandwidth_bps"]["unit"]) == \
        ("bytes", "s", "bit/s")
    assert (props["batch_size"]["unit"], props["target_loss"]["unit"]) == ("samples", "nats")  # given by the field
    assert "unit" not in props["port"] and "unit" not in props["tcp_nodelay"]


def test_a_section_names_a_known_group_and_ends_with_its_class():
    from pydantic_settings import BaseSettings

    from wiiide import config_types as config

    with pytest.raises(KeyError, match="sockets"):
        config._section("no-such-group")

    class Small(BaseSettings):
        config._section("sockets")
        buffer_bytes: int = config._field(4096, ">= 0", "a buffer")

    config._add_units(Small)
    assert Small.model_fields["buffer_bytes"].json_schema_extra == {"allowed": ">= 0", "group": "sockets",
                                                                     "unit": "bytes"}
    later = config._field(1, "any", "declared after the class's sections ended")
    assert "group" not in later.json_schema_extra


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
@pytest.mark.parametrize("field, value", [("checkpoint_every_steps", 10), ("checkpoint_every_s", 5.0)])
def test_the_torch_engines_refuse_checkpoints_with_the_reason(engine, field, value):
    with pytest.raises(ConfigError, match=rf"'{field}'.*needs engine wiiide.*fixed world"):
        RunConfig(engine=engine, **{field: value})
    assert getattr(RunConfig(**{field: value}), field) == value  # the wiiide engine takes them


@pytest.mark.parametrize("fields", [
    {"model": "transformer", "transformer_width": 32, "transformer_heads": 2}, {"model": "embedding"},
    {"grad_accum_steps": 4}, {"tls": True}, {"eval_every_s": 1.0}, {"local_steps": 16},
    {"local_steps": 4, "outer_optimizer": "nesterov", "compression": "fixed:int8"},
    {"local_steps": 4, "staleness_bound": 2}, {"local_steps": 4, "staleness_bound": "async"},
    {"local_steps": 4, "adaptive_batch": True}, {"staleness_bound": 2, "ssp_cache": True}])
def test_the_sharded_servers_take_every_dense_model_gradient_accumulation_tls_and_local_sgd(fields):
    assert RunConfig(ps_shards="all", **fields).ps_shards == "all"


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_ps_shards_on_a_torch_engine_is_an_error_only_off_its_default(engine):
    assert RunConfig(engine=engine).ps_shards == "all"  # the default, which the torch engines do not read
    with pytest.raises(ConfigError, match=r"'ps_shards': '1' needs engine wiiide"):
        RunConfig(engine=engine, ps_shards="1")


@pytest.mark.parametrize("fields", [{"staleness_bound": 2}, {"staleness_bound": "async", "staleness_scaling": "inverse"},
                                    {"adaptive_batch": True}, {"staleness_bound": 2, "adaptive_batch": True}])
def test_the_sharded_servers_take_bounded_staleness_async_and_adaptive_batches(fields):
    assert RunConfig(ps_shards="all", **fields).ps_shards == "all"


def test_both_placements_take_sparse_rows_at_every_pace_and_the_pace_server_takes_checkpoints():
    sparse = {"model": "embedding", "sparse_embedding": True, "momentum": 0.0}
    for shards in ("1", "all"):
        for pacing in ({}, {"staleness_bound": 2}, {"staleness_bound": "async"}, {"adaptive_batch": True},
                       {"local_steps": 4}, {"local_steps": 4, "staleness_bound": 2}, {"staleness_bound": 2, "ssp_cache": True}):
            assert RunConfig(ps_shards=shards, **sparse, **pacing).sparse_embedding
    for shards in ("1", "all"):
        with pytest.raises(ConfigError, match=r"'sparse_embedding'.*outer_optimizer nesterov \(the outer step's "
                                              r"momentum buffer moves every row"):
            RunConfig(ps_shards=shards, local_steps=4, outer_optimizer="nesterov", **sparse)
    for pacing in ({"staleness_bound": 2}, {"local_steps": 4}, {"adaptive_batch": True}):
        assert RunConfig(ps_shards="1", checkpoint_every_steps=10, **pacing).checkpoint_every_steps == 10


@pytest.mark.parametrize("pacing", [{"local_steps": 4}, {"local_steps": 4, "outer_optimizer": "nesterov"},
                                    {"staleness_bound": 2}, {"staleness_bound": "async"}, {"adaptive_batch": True}])
def test_the_sharded_servers_take_checkpoints_under_every_pacing(pacing):
    for trigger in ({"checkpoint_every_steps": 10}, {"checkpoint_every_s": 1.0}):
        assert RunConfig(ps_shards="all", num_workers=2, **pacing, **trigger).ps_shards == "all"
