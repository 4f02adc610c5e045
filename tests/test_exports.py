"""Each public module's ``__all__``, pinned: the public surface changes only on purpose.

A name added or removed here is an API change: record it in CHANGELOG.md.  Every listed name
must resolve on its module (lazy re-exports included).
"""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "sandbox_fs": [
        "ClientOptions", "DirEntry", "DirectoryReplacedError", "ExecResult", "Grant", "InvalidPathError",
        "LocalSandboxClient", "LocalSnapshotStore", "Manifest", "ManifestError", "MaterializationResult",
        "MaterializeOptions", "NativeUnavailableError", "NoSnapshot", "PathEscapeError", "PathPolicy",
        "ProcessSupervisor", "ReadOnlyError", "Root", "RunState", "SandboxError", "SandboxPath", "Session",
        "SessionState", "SnapshotStore", "SymlinkRefusedError", "UnsafeModeError", "WorkspaceClosedError",
        "features", "load_manifest", "materialize", "normalize", "open_root", "open_session", "run_confined",
    ],
    "sandbox_fs.errors": [
        "DirectoryReplacedError", "InvalidArgumentError", "InvalidPathError", "NativeUnavailableError",
        "PathEscapeError", "ReadOnlyError", "SandboxError", "SandboxOSError", "SymlinkRefusedError",
        "WorkspaceClosedError", "redact",
    ],
    "sandbox_fs.paths": [
        "GRANT_NAME_PATTERN", "Grant", "PathPolicy", "Resolved", "SandboxPath", "check_grant_name",
        "check_grant_names", "normalize",
    ],
    "sandbox_fs.root": [
        "CopyItem", "DirEntry", "Handle", "MAX_NAME_BYTES", "MAX_PATH_BYTES", "Root", "SpecialFileError", "Subtree",
        "UnsafeModeError", "display_path", "is_beneath", "open_host_device_fd", "open_host_dir_fd",
        "open_host_file_fd", "open_root",
        "write_host_file_atomic",
    ],
    "sandbox_fs.manifest": [
        "Archive", "Dir", "Entry", "EnvValue", "File", "FlatEntry", "LocalDir", "LocalFile", "MAX_ENTRIES",
        "MAX_INLINE_BYTES", "MAX_MANIFEST_BYTES", "Manifest", "ManifestError", "ManifestTrustError",
        "Mount", "Network", "REFUSED_ENV_NAMES", "REFUSED_ENV_PREFIXES", "Symlink", "check_destination", "check_link_target",
        "check_untrusted_environment", "load_manifest",
    ],
    "sandbox_fs.materialize": [
        "LimiterTokensError", "MaterializationResult", "MaterializeError", "MaterializeLimitError",
        "MaterializeOptions", "MaterializeProgress", "MountNeedsOverlayError", "MountRequest", "SkippedEntry",
        "SourceChangedError", "SourceRefusedError", "WrittenFile", "WrittenSymlink", "make_mount_points",
        "materialize", "plan_mounts",
    ],
    "sandbox_fs.client": [
        "ClientOptions", "LocalSandboxClient", "RunState", "STATE_VERSION", "SessionState",
        "SessionStateError", "SessionStateKeyMissingError", "SessionStateTamperedError", "SessionStateVersionError", "UnsafeKeyFileError", "open_session",
    ],
    "sandbox_fs.session": [
        "CrossRootError", "FeatureUnavailableError", "MountOverlapError", "PersistDisabledError", "Session",
        "SessionBusyError", "SessionConfig", "SessionError", "SessionNotStartedError",
        "SnapshotDigestMismatchError", "SnapshotGenerationError", "WORKSPACE_ID_NAME", "WorkspaceMismatchError",
    ],
    "sandbox_fs.snapshot": [
        "DirectorySnapshotStore", "GcReport", "GenerationStore", "HydrateReport", "LocalObjects", "LocalSnapshotStore", "NoSnapshot",
        "ObjectInfo", "ObjectStore", "ObjectWriter",
        "PersistReport", "S3Objects", "S3Options", "S3SnapshotStore", "SnapshotConflictError", "SnapshotCorruptError", "SnapshotError", "SnapshotInfo",
        "SnapshotLimitError", "SnapshotLimits", "SnapshotNotFoundError", "SnapshotPolicy",
        "SnapshotSourceChangedError", "SnapshotStore", "SnapshotStoreError", "SnapshotVerifyError",
        "UnrestorableEntryError", "fingerprint", "fork_snapshot", "hydrate", "persist", "tree_digest", "validate_name",
    ],
    "sandbox_fs.exec": [
        "CommandNotFoundError", "ConfinementError", "ConfinementPolicy", "DEFAULT_MAX_OUTPUT_BYTES",
        "DEFAULT_PATH", "DEFAULT_PROTECTED", "ENV_ALLOWLIST", "EgressEvent", "EgressLog", "EgressProxy", "ExecError", "ExecFailedError",
        "ExecResult", "ExecTimeoutError", "HostRule", "MAX_ENV_BYTES", "MAX_ENV_ENTRIES", "PrivateRoot",
        "ProcessSupervisor", "ProxyLimits", "PtyManager", "PtyNotFoundError", "Violation",
        "ViolationLog", "build_env", "build_ruleset",
        "helper_path", "run_confined", "violation_summary",
    ],
    "sandbox_fs.archive": [
        "ArchiveFormatError", "ArchiveLimitError", "ArchiveLimits", "ExtractPolicy", "ExtractReport",
        "FORMATS", "SkippedMember", "UnsafeArchiveMemberError", "extract", "extract_async",
    ],
    "sandbox_fs.fuse": [
        "AuditEvent", "FaultRule", "Overlay", "OverlayError", "OverlayMount", "OverlayPolicy",
        "OverlayUnavailableError", "mount_overlap", "overlap_text",
    ],
    "sandbox_fs.testing": [
        "ALLOWED_ERRNOS", "ATTACK_RULES", "AttackRecord", "Attacker", "HostNode", "HostTreePlan",
        "OutsideSentinel", "check_destination", "classify_failure", "hostile_host_trees", "hostile_tar_archives",
        "hostile_zip_archives", "sandbox_path_names",
    ],
    "sandbox_fs.cli": [
        "EXIT_INTERNAL", "EXIT_REFUSED", "EXIT_USAGE", "build_parser", "exception_leaves", "main",
    ],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_all_is_pinned(module):
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == PUBLIC[module]
    assert len(mod.__all__) == len(set(mod.__all__)), "a name is listed twice"
    missing = [name for name in mod.__all__ if not hasattr(mod, name)]
    assert missing == []
