"""`jax-specdec balance`: the closed-form balance of one drafted position, as a table."""

import pytest
from helpers import cli_refusal

from jax_specdec.cli import main


def test_balance_report_default(capsys):
    assert main(["balance"]) == 0
    out = capsys.readouterr().out
    assert "| accepted min(p, q)" in out
    assert "0.2000 | 0.3000 | 0.1000" in out  # accepted
    assert "0.0000 | 0.5000 | 0.5000" in out  # residual
    assert "0.2000 | 0.5000 | 0.3000" in out  # output
    assert "0.2800 | 0.5000 | 0.2200" in out  # wrong correction
    assert "rejected mass 0.4000" in out


def test_balance_report_custom(capsys):
    assert main(["balance", "--p", "0.5,0.5", "--q", "1,0"]) == 0
    out = capsys.readouterr().out
    assert "| output = accepted + rejected * residual | 0.5000 | 0.5000 |" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--p", "0.5,0.6"], "p must sum to 1"),
        (["--q", "0.5,0.5"], "same length"),
        (["--q", "1.5,-0.4,-0.1"], "q has negative"),
        (["--p", "a,b"], "comma-separated numbers"),
    ],
)
def test_balance_report_bad_input_exit_2_no_traceback(args, message, capsys):
    assert message in cli_refusal(["balance", *args], capsys)
