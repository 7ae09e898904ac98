"""Publish a bundle to a Hugging Face Hub model repository (``dwise-predict publish --hub``).

One repository holds one bundle, flat, at its root: ``bundle.json``, the files it lists and its
``README.md``, the model card with the Hub's front matter (:mod:`dwise_predict.exports.model_card`),
which the Hub shows as the repository's card. Versions are revisions: the commit goes to ``revision``
(a branch, ``main`` by default, created from ``main`` when missing), and ``version``, when given,
tags that commit; a tag that exists is never moved (the zoo's rule: a published version is never
overwritten). Each commit deletes the bundle files of the previous one that the new bundle does not
list (an optional ``refine.pt``, say), so a pull of the branch never meets a stray file. The bundle
is verified first, as for a zoo. Reading is :mod:`dwise_predict.bundles.hub`'s.
"""

from __future__ import annotations

from pathlib import Path

from dwise_predict.errors import InputError, StoreError
from dwise_predict.bundles.hub import DEFAULT_REVISION, HUB_FILES, check_repo_id, check_revision
from dwise_predict.bundles.manifest import BUNDLE_FILE, printable, read_bundle_manifest
from dwise_predict.bundles.screen import open_bundle, screen_bundle


def publish_hub(bundle: str | Path, repo_id: str, revision: str | None = None, version: str | None = None,
                verify: bool = True, private: bool | None = None, api=None) -> dict:
    """Verify ``bundle`` and commit it to the Hub repository ``repo_id`` (created when missing) on
    branch ``revision``; tag the commit ``version`` when given. ``api``: an ``huggingface_hub.HfApi``
    (default: a new one, with the token of ``hf auth login`` or ``HF_TOKEN``). Returns what was done:
    repo id, revision, version, commit hash and URL, the files uploaded."""
    bundle = Path(bundle)
    check_repo_id(repo_id)
    revision = revision or DEFAULT_REVISION
    check_revision(revision, "`revision`")
    if version is not None:
        check_revision(version, "`version`")
    manifest = read_bundle_manifest(bundle)
    if verify:
        from dwise_predict.exports.verify import require_verified

        require_verified(bundle)
    else:
        screen_bundle(bundle, open_bundle(bundle))
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    files = [BUNDLE_FILE, *sorted(manifest.files)]
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return _commit(api, bundle, repo_id, revision, version, private, files, manifest.name)
    except HfHubHTTPError as err:
        raise StoreError(f"the Hub refused the publish to {repo_id}@{revision} ({printable(str(err), 200)}): check "
                         "`hf auth login` and write access to the repository") from None


def _commit(api, bundle: Path, repo_id: str, revision: str, version: str | None, private: bool | None,
            files: list[str], name) -> dict:
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    if version is not None and version in {tag.name for tag in api.list_repo_refs(repo_id, repo_type="model").tags}:
        raise InputError(f"{repo_id} already has the tag {printable(version)}: published versions are never "
                         "overwritten; pass another `version`")
    if revision != DEFAULT_REVISION:
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
    label = f"{printable(name, quoted=False)}@{version}" if version else printable(name, quoted=False)
    commit = api.upload_folder(
        repo_id=repo_id, repo_type="model", folder_path=str(bundle), revision=revision,
        commit_message=f"dwise-predict publish {label}",
        allow_patterns=files,  # the files bundle.json lists, never what else the directory holds
        delete_patterns=list(HUB_FILES),  # a previous bundle's files this one does not list
    )
    if version is not None:
        api.create_tag(repo_id, tag=version, revision=commit.oid, repo_type="model",
                       tag_message=f"dwise-predict bundle {label}")
    return {"repo_id": repo_id, "revision": revision, "version": version, "commit": commit.oid,
            "url": commit.commit_url, "files": files}


__all__ = ["publish_hub"]
