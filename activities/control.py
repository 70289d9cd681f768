"""Activities of the control worker: checkpoint lookup, evaluation, registration and the
approval record. They are synchronous (run in a thread pool) because the
domain code they call is."""

from __future__ import annotations

import functools
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from temporalio import activity

from activities.decisions import DecisionActivities
from activities.errors import domain_errors
from activities.fetch import NodeCache, NodeCacheLease
from activities.heartbeat import beats_while_running, keep_alive
from infra.code_version import code_version, installed_packages, packages_digest
from infra.errors import IntegrityError, ObjectNotFound
from infra.extras import require_extra
from infra.settings import Settings
from registry.approvals import load_approvals, rules_for
from registry.fine_tune_sources import readable_checkpoint
from registry.lineage_tags import LineageTags
from registry.tracking import (
    DatasetUsed,
    Registration,
    close_run,
    open_run,
    register,
)
from registry.tracking import record_decision as record_version_decision
from trainer.attempt_clock import Mark, read_ledger
from trainer.checkpoint import vet_metadata
from trainer.checkpoint_manifest import CheckpointManifest
from trainer.errors import CheckpointError
from trainer.evaluate import checkpoint_val_loss, evaluate_checkpoint, load_model
from trainer.folder_export import export_folder
from trainer.manifest import (
    CommittedCheckpoint,
    counted,
    find_latest,
    load_for_init,
    newest_commit_of,
    read_manifest,
    record_generation,
)
from trainer.peer_tier import find_peer, peer_steps_of
from trainer.reported_eval import reported_evaluation
from trainer.run_identity import claim, pin
from workflows.contracts.models import (
    ApprovalPolicy,
    ApprovalPolicyInput,
    AttemptLedger,
    AttemptLedgerInput,
    CheckpointRef,
    CloseTrackingInput,
    DecisionInput,
    EvalPoint,
    EvalResult,
    EvalSource,
    EvaluateInput,
    FenceInput,
    Goodput,
    InitFromInput,
    LatestCheckpointInput,
    LedgerMark,
    ModelVersionRef,
    RegisterInput,
    Sample,
    TrackingInput,
)

if TYPE_CHECKING:  # trainer.serving pulls in mlflow.pyfunc, which only registration needs
    from trainer.serving import ServedCode


@dataclass(frozen=True)
class ModelFiles:
    """What a registered version is made of, as ControlActivities._model_files exported it."""

    manifest: CheckpointManifest
    artifacts: dict[str, str]  # by role (weights, config, tokenizer)
    served: ServedCode | None  # None: weights and lineage only
    folder_files: dict[str, str] = field(default_factory=dict)  # a script's, by folder path


def _reference(found: CommittedCheckpoint) -> CheckpointRef:
    """What the workflows keep of a committed checkpoint: its key and where it stands."""
    return CheckpointRef(
        manifest_key=found.key,
        step=found.step,
        generation=found.generation,
        tokens_seen=found.tokens_seen,
        bytes=sum(entry.bytes for entry in found.manifest.files),
    )


def goodput_metrics(goodput: Goodput) -> dict[str, float]:
    """Goodput as MLflow metrics: the fractions, and GPU-seconds by cause."""
    metrics = {
        "goodput": goodput.goodput,
        "goodput_of_allocated": goodput.allocated_goodput,
        "gpu_seconds": goodput.gpu_s,
        "gpu_seconds_productive": goodput.productive_gpu_s,
    }
    for cause, gpu_s in goodput.lost_gpu_s.items():
        metrics[f"gpu_seconds_lost.{cause.replace(' ', '_')}"] = gpu_s
    return metrics


def _ledger_mark(mark: Mark | None) -> LedgerMark | None:
    if mark is None:
        return None
    return LedgerMark(step=mark.step, at=mark.at, **mark.totals.model_dump())


def version_lineage(
    inp: RegisterInput, workflow_id: str, packages: list[str], servable: bool
) -> LineageTags:
    """What a registered version records of where it came from, its eval loss's source
    included: a script's own report is tagged as such, so no one reads it as measured."""
    code = code_version()
    user_code = inp.code
    evaluation = inp.evaluation
    return LineageTags(
        git_commit=code.commit,
        git_dirty=code.dirty,
        dataset_snapshot=inp.dataset.snapshot_id,
        dataset_manifest_key=inp.dataset.manifest_key,
        dataset_manifest_sha256=inp.dataset.manifest_sha256,
        spec_sha256=inp.spec_sha256,
        checkpoint_manifest_key=inp.checkpoint.manifest_key,
        checkpoint_step=inp.checkpoint.step,
        temporal_workflow_id=workflow_id,
        run=inp.run_id,
        owner=inp.spec.owner,
        val_loss=evaluation.val_loss,
        val_perplexity=evaluation.perplexity,
        eval_step=evaluation.step,
        packages_sha256=packages_digest(packages),
        eval_measured_on=evaluation.measured_on,
        # An evaluation from before its source was recorded came from the script on every
        # run of a user's code, and from Forgeline on the built-in trainer's.
        eval_source=evaluation.source or ("script" if user_code else "platform"),
        servable=servable,
        code_snapshot=user_code.snapshot_id if user_code else None,
        code_manifest_sha256=user_code.manifest_sha256 if user_code else None,
        entrypoint=(inp.spec.train.entrypoint or "") if user_code else None,
    )


class ControlActivities:
    def __init__(self, settings: Settings) -> None:
        # Registration logs a pyfunc model (mlflow.pyfunc needs pandas, which the full mlflow
        # brings): a control worker on a base install must say so when it starts, not at the
        # first registration hours into a run.
        require_extra("control", "the control worker")
        self.settings = settings
        self.store = settings.open_store()
        self.decisions = DecisionActivities(self.store)
        self.cache = NodeCache(
            settings.home / "cache" / "control", self.store, settings.node_cache_bytes()
        )

    @activity.defn(name="latest_checkpoint")
    @beats_while_running
    def latest_checkpoint(self, inp: LatestCheckpointInput) -> CheckpointRef | None:
        # Read the store, never heartbeat details: the last beats before a crash are lost.
        skipped: list[str] = []

        def skip(why: str) -> None:
            activity.logger.warning("skipping checkpoint %s", why)
            skipped.append(why)

        # Before anything is read: a prefix another run of this name holds is not this run's.
        with domain_errors():
            claim(self.store, inp.run_id, inp.run_uid)
        vet = functools.partial(vet_metadata, self.store)
        found = find_latest(
            self.store, inp.run_id, inp.max_generation, skip, vet,
            run_uid=inp.run_uid, at_most_step=inp.at_most_step,
        )  # fmt: skip
        stored = None if found is None else _reference(found)
        resume = stored
        # A new gang may resume from a newer peer-tier checkpoint (its files on the nodes),
        # the store's as the fallback; `resume --from` asks for a store checkpoint.
        if inp.new_gang and inp.at_most_step is None:
            peer = find_peer(self.store, inp.run_id, inp.max_generation, inp.run_uid, skip)
            if peer is not None and (stored is None or peer.step > stored.step):
                resume = _reference(peer).model_copy(update={"tier": "peer", "fallback": stored})
        if inp.fence:  # runs from before fence_generation fence here, in one activity
            self.fence_generation(
                FenceInput(run_id=inp.run_id, generation=inp.max_generation,
                           resume_step=resume.step if resume else 0, run_uid=inp.run_uid)
            )  # fmt: skip
        if resume is None:
            return None
        return resume.model_copy(update={"skipped": skipped})

    @activity.defn(name="fence_generation")
    @beats_while_running
    def fence_generation(self, inp: FenceInput) -> None:
        """Record that a generation starts from a step: an older generation still running
        (a partitioned node, a frozen host) then commits nothing that counts past it.
        Written once per generation: a retry finds it there."""
        record_generation(
            self.store, inp.run_id, inp.generation, inp.resume_step, run_uid=inp.run_uid
        )

    @activity.defn(name="attempt_ledger")
    @beats_while_running
    def attempt_ledger(self, inp: AttemptLedgerInput) -> AttemptLedger | None:
        """What one generation's rank 0 recorded of its time (trainer.attempt_clock), reduced
        to the marks goodput needs: ready, the kept checkpoint's step, the last step heard of."""
        ledger = read_ledger(self.store, inp.run_id, inp.generation)
        if ledger is None:  # the ranks never got as far as their first step
            return None
        kept_step = inp.kept_step
        if kept_step is None:  # the newest step of this generation either tier holds
            stored = newest_commit_of(self.store, inp.run_id, inp.generation)
            peer = peer_steps_of(self.store, inp.run_id, inp.generation)
            kept_step = max([s for s in (stored, *peer) if s is not None], default=None)
        if inp.kept_at_most and kept_step is not None:
            older = [m for m in ledger.commits if m.step <= kept_step]
            kept = max(older, key=lambda m: m.step, default=None)
        else:
            kept = next((m for m in ledger.commits if m.step == kept_step), None)
        return AttemptLedger(
            resume_step=ledger.resume_step,
            ready_at=ledger.ready_at,
            load_s=ledger.load_s,
            spawned_at=ledger.spawned_at,
            init_at=ledger.process_started_at,
            kept=_ledger_mark(kept),
            last=_ledger_mark(ledger.last),
            ended=ledger.ended,
        )

    @activity.defn(name="resolve_init_from")
    @beats_while_running
    def resolve_init_from(self, inp: InitFromInput) -> CheckpointRef:
        """Pin model.init_from to one verified checkpoint manifest, once, before training:
        a registered model is followed to the checkpoint it was made from."""
        with domain_errors():
            key = inp.source
            if key.startswith("models:/"):
                # Checked again here, not only at submission: an alias may have moved since.
                team = inp.team or None
                _version, key = readable_checkpoint(self.settings.mlflow_uri, inp.source, team)
            return _reference(load_for_init(self.store, key, inp.architecture))

    @activity.defn(name="evaluate")
    def evaluate(self, inp: EvaluateInput) -> EvalResult:
        train, prompts = inp.spec.train, inp.spec.registry.prompts
        if train.user_code:
            return self._reported_evaluation(inp)
        # The lease keeps what this evaluation fetched while it reads it: another activity's
        # fetch (or this one's, of older checkpoints) evicts only what no activity holds.
        with domain_errors(), keep_alive(), self.cache.lease() as cache:
            dataset = cache.dataset_manifest(inp.dataset)
            val_shards = cache.split(dataset, "val")
            folder, manifest = cache.checkpoint(inp.checkpoint)
            activity.heartbeat("checkpoint fetched")
            result = evaluate_checkpoint(
                checkpoint_folder=folder,
                model_config=manifest.network,
                val_shards=val_shards,
                dtype=dataset.dtype,
                tokenizer_file=cache.tokenizer(dataset),
                batch_size=train.batch_size,
                max_batches=train.eval_batches,
                prompts=prompts,
                sample_tokens=inp.spec.registry.sample_tokens,
                seed=train.seed,
            )
            curve = [EvalPoint(step=inp.checkpoint.step, val_loss=result.val_loss)]
            left_out: list[str] = []
            # The older checkpoints still kept give the curve's earlier points. One that does
            # not verify (rotted, pruned meanwhile) is left out of the curve with a note: the
            # model was trained and checked already, and is never lost to a curve.
            for kept in counted(self.store, inp.run_id):
                step = kept.step
                if step >= inp.checkpoint.step:
                    continue
                older = inp.checkpoint.model_copy(update={"manifest_key": kept.key, "step": step})
                try:
                    # Held only while its loss is taken: the curve's checkpoints together may
                    # not fit the cache, one at a time they do.
                    with self.cache.lease() as one:
                        older_folder, older_manifest = one.checkpoint(older)
                        loss = checkpoint_val_loss(
                            older_folder,
                            older_manifest.network,
                            val_shards,
                            dataset.dtype,
                            train.batch_size,
                            train.eval_batches,
                        )
                except (
                    IntegrityError,
                    ObjectNotFound,
                    CheckpointError,
                    KeyError,
                    ValueError,
                ) as err:
                    left_out.append(f"step {step}: {err}")
                    activity.logger.warning("val curve: leaving out step %s: %s", step, err)
                    continue
                curve.append(EvalPoint(step=step, val_loss=loss))
                activity.heartbeat(f"checkpoint {step} evaluated")
        return EvalResult(
            step=inp.checkpoint.step,
            val_loss=result.val_loss,
            perplexity=result.perplexity,
            val_tokens=result.val_tokens,
            sample=result.samples[0],
            samples=[
                Sample(prompt=p, text=t) for p, t in zip(prompts, result.samples, strict=True)
            ],
            curve=sorted(curve, key=lambda point: point.step),
            curve_left_out=left_out,
            source=EvalSource.PLATFORM,
        )

    def _reported_evaluation(self, inp: EvaluateInput) -> EvalResult:
        """A user's script evaluates its own model (run.report_eval); the manifests carry it."""
        with domain_errors():
            curve, final = [], None
            for kept in counted(self.store, inp.run_id):
                step = kept.step
                if step > inp.checkpoint.step:
                    continue
                found = reported_evaluation(kept.manifest)
                if found is None:
                    continue
                if step == inp.checkpoint.step:
                    final = found
                if found.measured_on == "held-out":
                    curve.append(EvalPoint(step=found.step, val_loss=found.val_loss))
            if final is None and inp.spec.train.keeps_its_own_checkpoints:
                # A script as it is reports nothing unless it calls forgeline.report: it is
                # registered without a loss, and no eval gate passes it.
                return EvalResult(
                    step=inp.checkpoint.step, val_loss=None, perplexity=None, val_tokens=0,
                    sample="", measured_on="nothing", source=EvalSource.SCRIPT,
                )  # fmt: skip
            if final is None:
                raise CheckpointError(
                    f"{inp.checkpoint.manifest_key} holds neither a held-out nor a training loss "
                    "of the script: it never called step.report() or run.report_eval()"
                )
        return EvalResult(
            step=final.step,
            val_loss=final.val_loss,
            perplexity=final.perplexity,
            val_tokens=final.val_tokens,
            sample="",
            curve=sorted({p.step: p for p in curve}.values(), key=lambda point: point.step),
            measured_on=final.measured_on,
            source=EvalSource.SCRIPT,  # the gate and the version say so: nothing checks it
        )

    @activity.defn(name="close_tracking_run")
    def close_tracking_run(self, inp: CloseTrackingInput) -> None:
        with domain_errors():
            close_run(self.settings.mlflow_uri, inp.mlflow_run_id, inp.status, inp.error)

    @activity.defn(name="open_tracking_run")
    @beats_while_running
    def open_tracking_run(self, inp: TrackingInput) -> str:
        """The MLflow run that tracks this training run from its start: the node agents stream
        the ranks' metrics into it, and registration logs the model into it."""
        spec = inp.spec
        return open_run(
            self.settings.mlflow_uri,
            run_name=inp.run_id,
            key=inp.workflow_run_id,
            params=spec.model_dump(exclude={"name", "owner"}),
            tags={
                "forgeline.run": inp.run_id,
                "forgeline.owner": spec.owner,
                "forgeline.team": spec.resources.team,
                "forgeline.temporal_workflow_id": activity.info().workflow_id,
                "forgeline.spec_sha256": inp.spec_sha256,
            },
        )

    @activity.defn(name="approval_policy")
    @beats_while_running
    def approval_policy(self, inp: ApprovalPolicyInput) -> ApprovalPolicy:
        """The operators' rules for this model, read once when it waits for approval; an
        approvals file that does not parse is retried, so fixing it unblocks the run."""
        rules = rules_for(load_approvals(self.store, self.settings.home), inp.model_name, inp.team)
        return ApprovalPolicy(
            approvers=list(rules.approvers),
            allow_self_approval=rules.allow_self_approval,
            max_val_loss=rules.max_val_loss,
            source=rules.source,
        )

    @activity.defn(name="register_model")
    @beats_while_running
    def register_model(self, inp: RegisterInput) -> ModelVersionRef:
        info = activity.info()
        with (
            domain_errors(),
            tempfile.TemporaryDirectory(prefix="forgeline-export-") as tmp,
            self.cache.lease() as cache,  # what the export reads stays while it reads it
        ):
            files = self._model_files(inp, cache, Path(tmp))
            manifest, served = files.manifest, files.served
            packages = installed_packages()
            lineage = version_lineage(inp, info.workflow_id, packages, served is not None).dump()
            final = inp.training[0] if inp.training else None
            metrics = {
                "val_loss": inp.evaluation.val_loss,
                "val_perplexity": inp.evaluation.perplexity,
                "restarts": float(inp.attempts),
                "tokens_seen": float(inp.checkpoint.tokens_seen),
            }
            # A script that reports no loss registers without one (its curve is its own).
            metrics = {k: v for k, v in metrics.items() if v is not None}
            if final is not None:
                metrics |= {
                    k: v
                    for k, v in {
                        "final_train_loss": final.final_loss,
                        "tokens_per_s": final.tokens_per_s,
                        "mfu": final.mfu,
                    }.items()
                    if v is not None
                }
            if inp.goodput is not None:
                metrics |= goodput_metrics(inp.goodput)
            texts = {
                "sample.txt": inp.evaluation.sample,
                "samples.json": json.dumps(
                    [s.model_dump() for s in inp.evaluation.samples], indent=2
                ),
                "spec.json": json.dumps(inp.spec.model_dump(), indent=2),
                "packages.txt": "\n".join(packages) + "\n",  # what packages_sha256 hashes
            }
            if inp.goodput is not None:
                texts["goodput.json"] = inp.goodput.model_dump_json(indent=2)
            if inp.health:
                texts["health.json"] = json.dumps(
                    [e.model_dump(mode="json") for e in inp.health], indent=2
                )
            # Before the version exists: its weights must outlive any later pruning.
            ref = inp.checkpoint
            pin(self.store, inp.run_id, ref.manifest_key, ref.step, ref.generation)
            registered = register(
                self.settings.mlflow_uri,
                Registration(
                    model_name=inp.spec.model_name,
                    team=inp.spec.resources.team,
                    run_name=inp.run_id,
                    params={
                        **inp.spec.model_dump(exclude={"name", "owner"}),
                        "dataset": inp.dataset.model_dump(),
                    },
                    metrics=metrics,
                    metric_series={
                        "train_loss": manifest.loss_history,
                        "val_loss_by_checkpoint": [
                            (p.step, p.val_loss) for p in inp.evaluation.curve
                        ],
                    },
                    run_tags=lineage,
                    version_tags=lineage,
                    artifacts=files.artifacts,
                    folder_files=files.folder_files,
                    python_model=served.entry if served else None,
                    code_modules=served.modules if served else (),
                    code_files=served.files if served else (),
                    model_config=served.config if served else None,
                    signature=served.signature if served else None,
                    pip_requirements=served.pip_requirements if served else [],
                    idempotency_key=inp.workflow_run_id,
                    texts=texts,
                    mlflow_run_id=inp.mlflow_run_id,
                    dataset=DatasetUsed(
                        name=f"snapshot-{inp.dataset.snapshot_id}",
                        uri=self._uri_of(inp.dataset.manifest_key),
                        digest=inp.dataset.manifest_sha256,
                        tags={"snapshot": inp.dataset.snapshot_id},
                    ),
                ),
            )
        return ModelVersionRef(
            model_name=registered.model_name,
            version=str(registered.version),  # an int from a SQLite store, a string over REST
            mlflow_run_id=registered.mlflow_run_id,
        )

    def _model_files(self, inp: RegisterInput, cache: NodeCacheLease, tmp: Path) -> ModelFiles:
        """What the version holds, written under `tmp`: the built-in GPT's served model, a
        user's weights (served by its own code where it said how), or the files a script that
        keeps its own checkpoints names in its final commit (registry.files)."""
        # Imported here: it pulls in mlflow.pyfunc, which only registration needs.
        from trainer.serving import export_model, served_code
        from trainer.weights_export import export_weights, user_served_code

        if inp.spec.train.keeps_its_own_checkpoints:
            manifest = read_manifest(self.store, inp.checkpoint.manifest_key)
            kept = export_folder(self.store, manifest, inp.spec.registry.files, tmp / "folder")
            return ModelFiles(manifest, artifacts={}, served=None, folder_files=kept)
        dataset = cache.dataset_manifest(inp.dataset)
        folder, manifest = cache.checkpoint(inp.checkpoint)
        if inp.code is not None:  # a user's model: its weights, served by its own code
            artifacts = export_weights(folder, manifest, cache.tokenizer(dataset), tmp)
            serving = manifest.serving
            served = user_served_code(cache.code(inp.code), serving) if serving else None
            return ModelFiles(manifest, artifacts, served)
        model = load_model(folder, manifest.network)
        artifacts = export_model(model, cache.tokenizer(dataset), tmp)
        return ModelFiles(manifest, artifacts, served_code())

    @activity.defn(name="record_decision")
    @beats_while_running
    def record_decision(self, inp: DecisionInput) -> None:
        with domain_errors():
            record_version_decision(
                self.settings.mlflow_uri,
                inp.version.model_name,
                inp.version.version,
                approver=inp.decision.approver,
                approve=inp.decision.approve,
                reason=inp.decision.reason,
                decided_at=inp.decided_at,
                expired=inp.expired,
                extra_tags=inp.tags,
            )

    def _uri_of(self, key: str) -> str:
        """Where a store key lives, as a URI MLflow can show (file:///… or s3://…)."""
        store = self.settings.store
        if "://" in store:
            return f"{store.rstrip('/')}/{key}"
        return (Path(store).resolve() / key).as_uri()

    def all(self) -> list:
        return [
            self.latest_checkpoint,
            self.fence_generation,
            self.attempt_ledger,
            self.resolve_init_from,
            self.evaluate,
            self.open_tracking_run,
            self.close_tracking_run,
            self.approval_policy,
            self.decisions.verify_decision,
            self.register_model,
            self.record_decision,
        ]
