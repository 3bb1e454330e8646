"""`harness.run.machine.cpu_identity`: what a report records of the host's CPU."""

from harness.run.machine import cpu_identity

_TWO_PROCESSORS = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 avx512f avx512_bf16 sha_ni

processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 85
model name\t: Intel Xeon
stepping\t: 7
flags\t\t: fpu sse2 avx
"""


def test_the_first_processor_gives_the_signature_and_the_vector_flags():
    cpu = cpu_identity(_TWO_PROCESSORS)
    assert cpu == {
        "model_name": "AMD EPYC",
        "signature": "AuthenticAMD family 25 model 17 stepping 1",
        "vector_flags": ["avx", "avx2", "avx512_bf16", "avx512f", "f16c", "fma", "sse4_1", "sse4_2"],
    }


def test_two_hosts_that_share_a_model_name_are_told_apart():
    zen1 = _TWO_PROCESSORS.replace("cpu family\t: 25\nmodel\t\t: 17", "cpu family\t: 23\nmodel\t\t: 1", 1)
    assert cpu_identity(zen1)["model_name"] == cpu_identity(_TWO_PROCESSORS)["model_name"]
    assert cpu_identity(zen1)["signature"] == "AuthenticAMD family 23 model 1 stepping 1"


def test_a_text_without_the_keys_gives_empty_fields():
    assert cpu_identity("") == {"model_name": "", "signature": None, "vector_flags": []}
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\n"
    assert cpu_identity(arm) == {"model_name": "", "signature": None, "vector_flags": []}
