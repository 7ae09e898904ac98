"""A Hugging Face Hub cache laid out by huggingface_hub's own functions, for the offline Hub tests."""

import os

from huggingface_hub.file_download import _cache_commit_hash_for_specific_revision, _create_symlink, repo_folder_name
from huggingface_hub.utils.sha import git_hash

GITATTRIBUTES = b"*.onnx filter=lfs diff=lfs merge=lfs -text\n"  # what the Hub adds to every repository


def cache_commit(cache, repo_id: str, commit: str, files: dict[str, bytes], refs=()) -> "os.PathLike":
    """Lay ``files`` out as huggingface_hub caches a downloaded commit: each blob once under
    ``blobs/`` (named by its git blob hash, as the Hub's ETag of a non-LFS file), linked from
    ``snapshots/<commit>/`` by the library's ``_create_symlink``, and each of ``refs`` (a branch or tag)
    pointing at the commit through ``_cache_commit_hash_for_specific_revision``."""
    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = storage / "blobs" / git_hash(data)
        blob.write_bytes(data)
        _create_symlink(str(blob), str(snapshot / name), new_blob=False)
    for ref in refs:
        _cache_commit_hash_for_specific_revision(str(storage), ref, commit)
    return snapshot
