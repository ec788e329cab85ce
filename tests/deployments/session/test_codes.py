"""One table of refusal codes: the enum, the docs and the parsers agree."""
import inspect
import re
from pathlib import Path

import pytest

import lingbot.camera.offline as offline_trajectories
from deployments.session.codes import ErrorCode, ProtocolError

DOCS = Path(__file__).parents[3] / "docs" / "architecture.md"


def test_the_docs_table_lists_exactly_the_codes():
    rows = re.findall(r"^\| `([a-z_]+)` \|", DOCS.read_text(), flags=re.M)
    assert sorted(rows) == sorted(code.value for code in ErrorCode)


def test_a_refusal_carries_a_code_of_the_table_and_only_one():
    error = ProtocolError("invalid_field", "seed must be an integer", event_id="e1")
    assert error.code is ErrorCode.INVALID_FIELD
    assert error.to_message() == {"type": "error", "code": "invalid_field", "message": "seed must be an integer",
                                  "event_id": "e1"}
    with pytest.raises(ValueError, match="'invald_field' is not a valid ErrorCode"):
        ProtocolError("invald_field", "a typo is a bug, caught where it is made")


def test_the_engine_trajectory_codes_are_in_the_table():
    """A bad camera_trajectory is refused with the engine's own code (lingbot.camera.TrajectoryError,
    raised in lingbot/camera/offline.py)."""
    codes = set(re.findall(r'TrajectoryError\("([a-z_]+)"', inspect.getsource(offline_trajectories)))
    assert codes == {"trajectory_shape", "trajectory_not_finite", "trajectory_not_rigid", "trajectory_intrinsics"}
    assert codes <= {c.value for c in ErrorCode}
