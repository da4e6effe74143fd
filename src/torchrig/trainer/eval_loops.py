"""``EvalLoops``: the evaluation loops (validate, test, the sanity check) and predict of a run; a
base of :class:`~torchrig.trainer.loops.Run`."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from torchrig.trainer.metrics import LOADER_SUFFIX, MetricStore, to_floats
from torchrig.trainer.run import num_batches
from torchrig.trainer.step_hooks import StepHooks


class EvalLoops(StepHooks):
    """``validation_step``/``test_step`` over a stage's loaders, and ``predict_step``."""

    def evaluate(self, stage: str, limit_override: float | None = None) -> list[dict[str, torch.Tensor]]:
        """Run ``validation_step``/``test_step`` over the stage's loaders; the epoch metrics per loader."""
        loaders = self.eval_loaders[stage if stage != "sanity_check" else "validate"]
        prepared = self.prepared_module
        assert prepared is not None
        method = prepared.module.test_step if stage == "test" else prepared.module.validation_step
        hook = _HOOK_STAGE[stage]
        store = self.eval_metrics
        store.reset()
        with self.log_into(store):
            if stage == "validate" and self.stage == "fit":
                self.emit("on_validation_model_zero_grad")
            self.emit(f"on_{hook}_model_eval")
            self.emit(f"on_{hook}_start")
            self.emit("on_eval_start", stage)
            self.emit(f"on_{hook}_epoch_start")
            with self.eval_context():
                for idx, loader in enumerate(loaders):
                    n = num_batches(loader, self.eval_limit(stage)) if limit_override is None else limit_override
                    if len(loaders) > 1:  # each loader's values kept apart: name/dataloader_idx_N
                        with self.log_into(store, suffix=f"{LOADER_SUFFIX}{idx}"):
                            self.eval_loader(stage, method, loader, idx, n)
                    else:
                        self.eval_loader(stage, method, loader, None, n)
                self.emit(f"on_{hook}_epoch_end")
            results = self.end_evaluation(stage, store, len(loaders))
            if stage == "validate" and self.stage == "fit":
                # Done: a checkpoint saved from on_validation_end resumes after this validation.
                self.trainer.fit_state.val_pending = False
            self.emit(f"on_{hook}_end")
            self.emit(f"on_{hook}_model_train")
            return results

    def end_evaluation(self, stage: str, store: MetricStore, count: int) -> list[dict[str, torch.Tensor]]:
        tr = self.trainer
        values = store.epoch_values()
        results = _split_by_loader(values, count)
        store.reduced = True
        # The callbacks read them at on_validation_end, also the sanity check's (whose values the
        # fit forgets after it, as Lightning does).
        self.epoch_metrics.update(store.callback_values(values))
        if stage != "sanity_check":
            logged = store.logger_keys(values)
            if logged and self.stage == "fit":
                self.log_to_loggers({**logged, "epoch": tr.fit_state.epoch})
            elif logged:
                self.log_to_loggers(logged)
        self.emit("on_eval_end", stage)
        return results

    def eval_loader(self, stage: str, method: Any, loader: Any, idx: int | None, n: float) -> None:
        prepared = self.prepared_module
        assert prepared is not None
        if n <= 0:
            return
        call = self.trainer.rig.strategy.step_caller(prepared, method)
        with_idx = idx is not None and _takes_loader_index(method)
        hook = _HOOK_STAGE[stage]
        start, end = self.hooks(f"on_{hook}_batch_start"), self.hooks(f"on_{hook}_batch_end")
        eval_end, extra = self.hooks("on_eval_batch_end"), () if idx is None else (idx,)
        sink = self.sink  # the sink of this loader's values
        for batch_idx, batch in enumerate(self.transferred(loader, idx or 0)):
            sink.batch = batch
            for hook_fn in start:
                hook_fn(batch, batch_idx, *extra)
            output = call(batch, batch_idx, idx) if with_idx else call(batch, batch_idx)
            for hook_fn in end:
                hook_fn(output, batch, batch_idx, *extra)
            for hook_fn in eval_end:
                hook_fn(stage, output, batch, batch_idx)
            if batch_idx + 1 >= n:
                break
        sink.batch = None  # the epoch-end hooks log outside any batch

    def predict(self) -> list[Any] | None:
        """Predictions per batch, in dataset order, gathered from every process (None when
        ``trainer.predict(return_predictions=False)``: each process keeps its own, for a
        :class:`~torchrig.BasePredictionWriter` to write, and nothing is gathered).

        On ``W`` processes each returned batch holds the ``W`` per-process batches of one step,
        interleaved back into dataset order (:meth:`torchrig.Rig.gather_for_metrics`).
        """
        tr = self.trainer
        prepared = self.prepared_module
        assert prepared is not None
        loaders = self.eval_loaders["predict"]
        self.emit("on_predict_model_eval")
        self.emit("on_predict_start")
        self.emit("on_eval_start", "predict")
        self.emit("on_predict_epoch_start")
        start, end = self.hooks("on_predict_batch_start"), self.hooks("on_predict_batch_end")
        eval_end = self.hooks("on_eval_batch_end")
        results: list[Any] = []
        keep, track = self.return_predictions, self.track_batch_indices()
        with self.eval_context():
            for idx, loader in enumerate(loaders):
                n = num_batches(loader, tr.limit_predict_batches)
                outputs: list[Any] = []
                method = self.require_module().predict_step
                predict_step = tr.rig.strategy.step_caller(prepared, method)
                indices = batch_indices(loader) if track else None
                self.predict_dataloader_idx = idx
                extra = (idx,) if len(loaders) > 1 else ()
                step_extra = extra if _takes_loader_index(method) else ()
                for batch_idx, batch in enumerate(self.transferred(loader, idx)):
                    if batch_idx >= n:
                        break
                    for hook in start:
                        hook(batch, batch_idx, *extra)
                    out = predict_step(batch, batch_idx, *step_extra)
                    if indices is not None:
                        self.predict_batch_indices = indices[batch_idx] if batch_idx < len(indices) else []
                    for hook in end:
                        hook(out, batch, batch_idx, *extra)
                    for hook in eval_end:
                        hook("predict", out, batch, batch_idx)
                    if keep:  # in dataset order, each sample once (the sampler's padding dropped)
                        outputs.append(tr.rig.gather_for_metrics(out))
                results.append(outputs)
        self.emit("on_predict_epoch_end")
        self.emit("on_predict_end")
        self.emit("on_eval_end", "predict")
        if not keep:
            return None
        return results[0] if len(results) == 1 else results


def batch_indices(loader: Any) -> list[list[int]] | None:
    """The dataset indices of each batch this process's ``loader`` yields (for prediction
    writers), read from its batch sampler; None for a loader without one (an iterable dataset)."""
    inner = getattr(loader, "loader", loader)
    sampler = getattr(inner, "batch_sampler", None)
    if sampler is None:
        return None
    epoch = getattr(loader, "epoch", None)  # the epoch the next iter() runs: the same order
    if epoch is not None and hasattr(inner.sampler, "set_epoch"):
        inner.sampler.set_epoch(epoch + 1)
    return [list(batch) for batch in sampler]


#: Which Lightning hooks (``on_<this>_start``...) an evaluation stage calls.
_HOOK_STAGE = {"sanity_check": "validation", "validate": "validation", "test": "test", "predict": "predict"}


def _takes_loader_index(method: Any) -> bool:
    """Whether a ``*_step`` accepts ``dataloader_idx`` (passed only with several loaders)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind is p.VAR_POSITIONAL for p in params) or len(params) >= 3


def _split_by_loader(values: dict[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    if count <= 1:
        return [dict(values)]
    out: list[dict[str, torch.Tensor]] = []
    for idx in range(count):
        suffix = f"{LOADER_SUFFIX}{idx}"
        out.append({k: v for k, v in values.items() if k.endswith(suffix) or LOADER_SUFFIX not in k})
    return out


def metrics_as_floats(results: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    return [to_floats(dict(r)) for r in results]
