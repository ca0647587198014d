"""The gloo spawn helper: a signal in gloo's teardown after every rank passed is tolerated (with a
warning); a rank that dies before its checks are done still fails the test."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from tests.distributed import spawn_workers
from tests.distributed.helpers import spawn


def test_an_abort_in_teardown_after_every_rank_passed_only_warns():
    with pytest.warns(UserWarning, match="SIGABRT in gloo's teardown after every rank passed"):
        spawn(spawn_workers.abort_in_teardown, 2)


def test_an_abort_before_the_checks_are_done_fails():
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        spawn(spawn_workers.abort_while_working, 2)
