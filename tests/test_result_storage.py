"""`store.results` as a saved Prefect block ("type-slug/name", what a multi-host setup points at S3) or a path."""

from __future__ import annotations

import pytest

from rollflow.flows.config import RunConfig
from rollflow.flows.debug import replay_result_storage


def test_a_saved_filesystem_block_slug_loads_that_block(prefect_api, tmp_path):
    from prefect.blocks.system import Secret
    from prefect.filesystems import LocalFileSystem, RemoteFileSystem

    RemoteFileSystem(basepath="s3://bucket/results").save("rf-results-remote", overwrite=True)
    LocalFileSystem(basepath=str(tmp_path)).save("rf-results-local", overwrite=True)
    Secret(value="x").save("rf-not-a-filesystem", overwrite=True)

    remote = replay_result_storage(RunConfig(store={"results": "remote-file-system/rf-results-remote"}))
    assert isinstance(remote, RemoteFileSystem) and remote.basepath == "s3://bucket/results"
    local = replay_result_storage(RunConfig(store={"results": "local-file-system/rf-results-local"}))
    assert isinstance(local, LocalFileSystem) and local.basepath == str(tmp_path)
    with pytest.raises(ValueError, match="store.results='secret/rf-not-a-filesystem' is a Secret block"):
        replay_result_storage(RunConfig(store={"results": "secret/rf-not-a-filesystem"}))


def test_a_path_is_a_path_and_none_is_prefects_default(tmp_path):
    assert replay_result_storage(RunConfig(store={"results": str(tmp_path)})) == tmp_path
    assert replay_result_storage(RunConfig()) is None
