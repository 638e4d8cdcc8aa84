"""The version number clients compare against upstream releases (docs/compatibility.md)."""

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import transformer_engine

# The upstream surface these tests and tests/pytorch/test_upstream_surface.py follow: the 2.20
# release line (the reference snapshot reads 2.20.0.dev0).
UPSTREAM_RELEASE = (2, 20)


def test_version_is_the_followed_upstream_release():
    version = Version(transformer_engine.__version__)
    assert version.release[:2] == UPSTREAM_RELEASE
    # A final release: checks that leave out pre-releases must still accept it.
    assert not version.is_prerelease and not version.is_devrelease


@pytest.mark.parametrize(
    "gate",
    [
        ">=0.11.0",  # Lightning's Transformer Engine precision plugin
        ">=0.12.0",  # Megatron-LM: modules built with device=
        ">=1.7.0",
        ">=2.0.0",
        ">=2.7.0",
    ],
)
def test_client_version_gates_pass(gate):
    # SpecifierSet.contains leaves pre-releases out by default, as requirement checks do.
    assert SpecifierSet(gate).contains(transformer_engine.__version__)


def test_older_gates_compare_like_upstream():
    # Megatron-LM's is_te_min_version: Version(te.__version__) >= Version(v).
    version = Version(transformer_engine.__version__)
    assert version >= Version("2.20.0.dev0")
    assert version < Version("2.21.0")
