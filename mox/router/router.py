"""The router: who gets memory. It admits requests, tracks each model's traffic, loads cold
models' weights off the engine thread, and divides one device budget among the models.

Design note.
- Device memory = dense weights of the models that hold them + every model's expert slots
  (the KV pool has its own budget). `residency.used_bytes() <= device_memory` after every
  call; plans are applied through `mox.router.residency`.
- A request for a cold model queues in the engine at once; the model's dense weights load
  on the loader thread (after parking idle models if room is short) while the other models
  keep stepping; the plan gives it experts at once and, while its rate rises, its most used
  experts are prefetched (where prefetch is on: a GPU by default). It runs from the first
  step after its weights land.
- Every `plan_period_s` (and when a model starts loading or lands) the router hands the
  memory policy a frozen view of the models (`_view`) and applies the plan it returns
  (`_apply`): parks, expert slots per model (the pools evict only unleased experts; shrinks
  before grows, so the sum never passes the budget), loads of cold models it admitted.
- A warm model idle for `dense_idle_s` (or its own keep-alive) is parked: its weights and
  slots leave the device. A pinned model (the operator's `mox models set --pin`) loads whole
  at once and is never parked; its priority weights its value in the plan.
- Admission (mox.router.admission): per-model and global limits on waiting requests
  (AdmissionError, HTTP 429); a request still waiting after `queue_timeout_s` is aborted
  with RequestTimeoutError.
The router is single-threaded like the engine it drives (the offline LLM's thread, or the
driver's: mox.router.driver); only the loader thread's results cross over (`WeightLoader`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import IO

import msgspec

from mox.engine import Engine, StepInfo
from mox.engine.scheduler import SchedulerConfig
from mox.errors import (
    CheckpointError,
    InvalidRequestError,
    ModelNotFoundError,
    ModelUnavailableError,
    MoxError,
    RequestTimeoutError,
)
from mox.messages import ModelSettings, ModelState, Request, RequestOutput
from mox.models.loading import prefetch_by_default
from mox.pager import make_pager
from mox.router.admission import Admission
from mox.router.config import RouterConfig
from mox.router.memory_policy import (
    Admitted,
    ColdStart,
    MemoryPlan,
    MemoryPolicy,
    MemoryView,
    make_memory_policy,
)
from mox.router.residency import Residency
from mox.router.served_model import (
    ServedModel,
    WeightLoader,
    open_served,
    resolve_device,
    resolve_dtype,
)
from mox.router.timeline import ModelEvent, StepRecord, Timeline
from mox.router.views import memory_view

log = logging.getLogger("mox.router")


class Router:
    def __init__(self, models: dict[str, str], config: RouterConfig | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 settings: dict[str, ModelSettings] | None = None) -> None:
        config = config or RouterConfig()
        self.config = config
        self.clock = clock
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.pager = make_pager(self.device, config.host_memory, config.direct_io, clock)
        self.engine = Engine(config.kv_memory,
                             config=SchedulerConfig(max_batched_tokens=config.max_batched_tokens,
                                                    tpot_target_s=config.tpot_target_s,
                                                    decode_steps=config.decode_steps),
                             compute_threads=config.compute_threads,
                             max_threads=config.max_compute_threads,
                             io_busy=lambda: self.pager.loader.reader.busy,
                             interrupt=self._interrupted)
        self.policy: MemoryPolicy = make_memory_policy(config.policy)
        self.models: dict[str, ServedModel] = {}
        # predictive prefetch (next layer's experts, popular experts into grown pools)
        self.prefetch = (config.prefetch if config.prefetch is not None
                         else prefetch_by_default(self.device))
        self.residency = Residency(self.models, self.pager.loader.host_cache, clock)
        self.admission = Admission(config.max_waiting_per_model, config.max_waiting,
                                   config.queue_timeout_s)
        self.timeline = Timeline(_open_step_log(config.step_log) if config.step_log else None)
        self.wake = threading.Event()          # set when a load lands (drivers wait on it)
        self._loader = WeightLoader(self.wake)
        # whether the driver holds work the router has not seen (AsyncEngine's inbox; the
        # driver sets it): it, or weights that landed, end a run of decode steps
        self.outside_waiting: Callable[[], bool] = lambda: False
        self._next_plan = -math.inf
        # how a request for each cold model would start (`snapshot`'s `cold_start`), as of
        # the last plan, park or load; read on the event loop, replaced whole on this thread
        self._cold_starts: dict[str, ColdStart] = {}
        self._cold_starts_stale = False
        for name, path in models.items():
            self.add_model(name, path, (settings or {}).get(name))

    # ---- models ------------------------------------------------------------------------
    def add_model(self, name: str, path: str, settings: ModelSettings | None = None,
                  replace: bool = False) -> ServedModel:
        """Serve the checkpoint at `path` as `name` (`replace`: in place of a closed model of
        that name); a checkpoint that cannot be opened gives a FAILED model saying why."""
        if name in self.models and not replace:
            raise InvalidRequestError(f"model {name!r} is already served", param="model")
        model = open_served(name, path, self.dtype)
        model.settings = settings or ModelSettings()
        self.models[name] = model
        if model.state == ModelState.FAILED:
            return model
        model.pool = self.pager.add_model(name, model.ckpt, self.dtype, self.device, 0,
                                          self.policy.eviction_policy, self.prefetch)
        self.engine.add_model(name, model.ckpt.spec, self.dtype, self.device, model.tokenizer,
                              model.eos_token_ids)
        error = self._unfit(name)
        if error and model.settings.pin:                 # the budget can hold it, not pinned
            log.warning("model %s serves unpinned: %s", name, error)
            model.settings = msgspec.structs.replace(model.settings, pin=False)
            error = self._unfit(name)
        if error:
            model.state, model.error = ModelState.FAILED, error
            self.engine.remove_model(name)           # so it holds no share of the budget
            model.pool.close()
            model.pool = None
            return model
        if self.policy.pins_models:
            self._start_load(model, whole=True)
        elif model.settings.pin:
            self._try_start_loads()                # as soon as admission finds it room
        return model

    def _unfit(self, name: str) -> str | None:
        """Why the budget can never run the model as it is set up, or None."""
        try:
            self._check_fits(self._view(whole_budget=True), name)
        except MoxError as e:
            return str(e)
        return None

    def _check_fits(self, view: MemoryView, name: str) -> None:
        """The model must fit as it is set up, and leave every other model room to run: a
        model that shrinks an equal split below another's top_k, or a pin that leaves
        another less than its minimum, is refused (MoxError), not the models serving."""
        self.policy.check_fits(view, name)
        for other in view.models:
            if other.name == name:
                continue
            try:
                self.policy.check_fits(view, other.name)
            except MoxError as e:
                raise MoxError(f"serving model {name!r} as set up would leave model "
                               f"{other.name!r} unable to run: {e}") from None

    def configure(self, name: str, settings: ModelSettings) -> None:
        """New operator settings for a served model: a newly pinned cold model loads whole as
        soon as admission finds it room. Refused (MoxError, nothing changed) if the budget
        can never hold it pinned, or cannot now beside the models holding memory."""
        model = self.served(name)
        previous, model.settings = model.settings, settings
        try:
            view = self._view()
            self._check_fits(view, name)
            if not self.policy.holding_fits(view):
                raise MoxError(f"model {name!r} cannot be pinned while the models holding "
                               "memory need the rest of the budget; try again when they idle")
        except MoxError:
            model.settings = previous
            raise
        if model.state == ModelState.COLD:
            self._try_start_loads()
        else:
            self.replan()

    def remove_model(self, name: str) -> list[RequestOutput]:
        """Stop serving the model: its requests abort, its memory is freed (a loading
        model's once its load lands)."""
        model = self.models.get(name) or self.served(name)
        reason = ModelNotFoundError(f"model {name!r} was removed")
        if model.state == ModelState.LOADING:
            outputs = self._abort_requests_of(name, reason)
            self.engine.remove_model(name)
            self.residency.closing.append(model)
        else:
            outputs = self._close_model(name, reason)
        del self.models[name]
        return outputs

    def _close_model(self, name: str, reason: MoxError) -> list[RequestOutput]:
        """Abort the model's requests with `reason` and free its memory; it stays listed."""
        model = self.models.get(name) or self.served(name)
        outputs = self._abort_requests_of(name, reason)
        if model.state == ModelState.LOADING:
            self._loader.drain()                              # let its load land first
            # (with it may land another model's failed load, whose requests end here)
            outputs += self._install_landed()
        if model.state == ModelState.WARM:
            self.park(model, "closed")
        if model.pool is not None:
            self.engine.remove_model(name)
            model.pool.close()
        return outputs

    def reopen(self, name: str) -> ServedModel:
        """The model opened again from its files (e.g. a failed one, its files repaired):
        its requests abort, and it starts cold, or failed again with the reason. It stays
        listed throughout (a reader on another thread never finds it missing)."""
        model = self.models.get(name) or self.served(name)
        self._close_model(name, ModelUnavailableError(f"model {name!r} is being reopened"))
        return self.add_model(name, model.path, model.settings, replace=True)

    def warm_up(self, name: str, whole: bool | None = None) -> None:
        """Load the model now and wait for it (the offline LLM's start-up); `whole`: every
        expert too (None: as the policy loads whole models or not)."""
        model = self.models.get(name) or self.served(name)
        if model.state == ModelState.COLD:
            self._start_load(model, self.policy.loads_whole_models if whole is None else whole)
        while model.state == ModelState.LOADING:
            self.wake.wait()
            self.wake.clear()
            self._install_landed()
        if model.state == ModelState.FAILED:
            raise ModelUnavailableError(model.error)

    def served(self, name: str) -> ServedModel:
        """The model by name; ModelNotFoundError if unknown, ModelUnavailableError (with the
        reason) if it failed to open or load."""
        model = self.models.get(name)
        if model is None:
            raise ModelNotFoundError(f"model {name!r} is not served")
        if model.state == ModelState.FAILED:
            raise ModelUnavailableError(f"model {name!r} failed to load: {model.error}")
        return model

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        model = self.served(request.model)
        now = self.clock()
        self.admission.check(model.name, self.engine.num_waiting(model.name),
                             sum(self.engine.num_waiting(name) for name in self.models), now)
        idle = model.state == ModelState.WARM and not self.has_requests(model.name)
        self.engine.add_request(request)            # validates the prompt
        self.admission.track(request.request_id, model.name, now)
        model.traffic.on_arrival(now)
        model.last_active = now
        if idle:
            model.turn_run_slots = 0         # its last turn ended when it went idle
            self._readmit(model)
        if model.state == ModelState.COLD:
            self._try_start_loads()
        elif model.pool.num_slots == 0:
            self.replan()                    # warm but planned out: its floor comes now

    def abort(self, request_id: str, error: MoxError | None = None) -> RequestOutput | None:
        self.admission.forget(request_id)
        return self.engine.abort(request_id, error)

    def take_error(self, request_id: str) -> Exception | None:
        """Why the request aborted, if it failed (its owner takes it once)."""
        return self.engine.take_error(request_id)

    def has_requests(self, name: str) -> bool:
        return self.engine.has_requests(name)

    # ---- the loop ----------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """Is a step useful now (a runnable batch, or loaded weights to install)?"""
        return self._loader.has_landed or self.engine.has_work

    def step(self) -> list[RequestOutput]:
        now = self.clock()
        outputs = self._install_landed()
        outputs += self._expire(now)
        self._park_idle(now)
        self._park_drained()
        self._try_start_loads()
        if now >= self._next_plan:
            self.replan()
        if self._cold_starts_stale:
            self._refresh_cold_starts()
        try:
            stepped = self.engine.step()
        except CheckpointError as e:       # a file damaged or lost while the model was warm
            failed = self.models[self.engine.last_step.model]
            log.error("model %s failed: %s", failed.name, e)
            return outputs + self._fail(failed, e, "failed")
        self._record(self.engine.last_step)
        self._account(stepped)
        return outputs + stepped

    def _record(self, step: StepInfo | None) -> None:
        """The line in the timeline of a step that ended: its batch and what it took."""
        if step is None:
            return
        model = self.models[step.model]
        self.timeline.add(StepRecord(
            step.started, step.model, step.num_seqs, step.num_tokens, step.num_prefill_tokens,
            step.seconds, step.cpu_seconds, step.stall_seconds, step.misses, step.waves,
            step.bytes_read, sum(self.has_requests(n) for n in self.models if n != step.model),
            step.parked_seconds, model.pool.num_slots if model.pool else 0,
            model.turn_run_slots, step.capture_seconds))

    def _interrupted(self) -> bool:
        """The engine's `interrupt`: something waits that a run of decode steps delays."""
        return self.outside_waiting() or self._loader.has_landed

    def step_in_progress(self) -> tuple[float, str] | None:
        """(seconds its current slice has run, what) of the step running now, or None; safe
        from any thread (the watchdog's)."""
        step = self.engine.current_step
        if step is None:
            return None
        model = self.models.get(step.model)
        waiting = None if model is None or model.pool is None else model.pool.waiting_on
        return (time.monotonic() - self.engine.slice_started,
                f"model {step.model!r}, {step.num_seqs} sequences, {step.num_tokens} tokens "
                f"({step.num_prefill_tokens} prefill); "
                f"{'waiting for ' + waiting if waiting else 'computing'}")

    def seconds_until_due(self) -> float | None:
        """When `step()` next has timed work (a plan, a timeout, an idle park); None: never
        until something arrives. Drivers wait on `wake` at most this long."""
        now = self.clock()
        expiry = self.admission.next_expiry()
        due = [] if expiry is None else [expiry]
        if any(m.holds_device_memory for m in self.models.values()):
            due.append(self._next_plan)
        due += [t for m in self.models.values() if (t := self._park_at(m)) is not None]
        return max(0.0, min(due) - now) if due else None

    def _account(self, outputs: list[RequestOutput]) -> None:
        now = self.clock()
        for out in outputs:
            name = self.admission.on_output(out.request_id, out.finish_reason is not None, now)
            if name is not None:
                model = self.models[name]
                model.traffic.on_tokens(now, len(out.new_token_ids))
                model.last_active = now

    def _expire(self, now: float) -> list[RequestOutput]:
        limit = self.config.queue_timeout_s
        outputs = []
        for rid, model in self.admission.expired(now):
            error = RequestTimeoutError(f"request waited more than {limit:g} s for model "
                                        f"{model!r} (state {self.models[model].state.value})")
            outputs += [out for out in [self.abort(rid, error)] if out is not None]
        return outputs

    # ---- loading and parking -----------------------------------------------------------
    def _try_start_loads(self) -> None:
        """Start loading cold models that have requests (or are pinned), if the policy finds
        room for them (parking idle models if it must); otherwise they wait for a busy model
        to go idle, or for the policy to drain one (a turn, `MemoryPolicy.drain`)."""
        if not any(m.state == ModelState.COLD and (self.has_requests(m.name) or m.settings.pin)
                   for m in self.models.values()):
            return
        view = self._view()
        victim = self.policy.drain(view)
        if victim is not None:             # draining frees nothing yet: admission is the same
            self._drain(self.models[victim])
        admitted = self.policy.admit(view)
        if admitted.load or admitted.park:
            self._apply(self.policy.plan(admitted))

    def _start_load(self, model: ServedModel, whole: bool) -> None:
        """Load the model now, without asking the policy to admit it (all-resident's start-up,
        the offline LLM's warm-up); `whole`: every expert too, waited for."""
        self._mark_loading(model)
        self.replan()
        self._begin_load(model, model.pool.max_slots if whole else 0, stream=False)

    def _begin_load(self, model: ServedModel, preload: int, stream: bool) -> None:
        """Its dense weights and `preload` experts go to the loader thread (`stream`: it runs
        once the dense weights land)."""
        self.timeline.event(ModelEvent("load", self.clock(), model.name, preload, stream))
        self._loader.start(model, self.dtype, self.device, preload, stream)

    def _drain(self, model: ServedModel) -> None:
        """The model starts no new request; it is parked once its running ones finish
        (`_park_drained`)."""
        model.draining = True
        self.engine.set_draining(model.name, True)
        self.timeline.event(ModelEvent("drain", self.clock(), model.name))

    def _mark_loading(self, model: ServedModel) -> None:
        """Its dense bytes count from now on, so the plan that follows leaves room for them."""
        model.state = ModelState.LOADING
        model.num_loads += 1
        model.loaded_at = self.clock()

    def _park_drained(self) -> None:
        """Drained models whose running requests are done leave; their waiting ones wait for
        admission like any cold model's."""
        for model in list(self.models.values()):
            if (model.draining and model.state == ModelState.WARM
                    and self.engine.num_running(model.name) == 0):
                self.park(model, "drained")

    def _install_landed(self) -> list[RequestOutput]:
        landed = self._loader.take_landed()
        outputs = []
        for name, result in landed:
            # (one load a model at a time, in order: the first closing one of a name is it)
            closing = next((m for m in self.residency.closing if m.name == name), None)
            if closing is not None:
                self.residency.closing.remove(closing)
                closing.pool.close()
                continue
            model = self.models[name]
            failed = isinstance(result, BaseException)
            self.timeline.event(ModelEvent("failed" if failed else "landed", self.clock(), name))
            if failed:
                outputs += self._fail(model, result)
            else:
                model.decoder, model.state = result, ModelState.WARM
                self.engine.set_weights(name, result)
        if landed:
            self.replan()
        return outputs

    def _fail(self, model: ServedModel, error: BaseException,
              what: str = "failed to load") -> list[RequestOutput]:
        """The model serves nothing more until it is re-added: its requests, running or
        waiting, end with `error`, and its memory is freed."""
        outputs = self._abort_requests_of(
            model.name, ModelUnavailableError(f"model {model.name!r} {what}: {error}"))
        if model.state == ModelState.WARM:
            self.park(model, "closed")
        model.pool.resize(0)
        model.state, model.error = ModelState.FAILED, str(error)
        return outputs

    def _abort_requests_of(self, name: str, reason: MoxError) -> list[RequestOutput]:
        """End every request of the model, running or waiting, with `reason`."""
        return [out for rid in self.admission.of_model(name)
                if (out := self.abort(rid, reason)) is not None]

    def _park_at(self, model: ServedModel) -> float | None:
        """When the model is due to be parked for idleness (None: not while it stays so)."""
        if (model.state != ModelState.WARM or self.policy.pins_models or model.settings.pin
                or self.has_requests(model.name)):
            return None
        keep_alive = model.settings.keep_alive_s
        return model.last_active + (self.config.dense_idle_s if keep_alive is None
                                    else keep_alive)

    def _park_idle(self, now: float) -> None:
        for model in list(self.models.values()):
            due = self._park_at(model)
            if due is not None and now > due:
                self.park(model, "idle")

    def _readmit(self, model: ServedModel) -> None:
        """A warm idle model's first request: it runs now if the policy would admit it cold
        (parking idle models to make room, as for a cold one); otherwise it is parked and waits
        for admission like a cold model, since a pool squeezed below its run size would slow
        every busy model (mox.router.planner). Admitted, it reads ahead what a cold start
        would (its run size's most used experts) into the pool its idle time shrank: met as
        misses instead, they park its steps one wave at a time for the whole turn (the
        16-model load test: 244 of 316 missing decode steps, bench/results/harness-16-avx2-
        0.4-l)."""
        view = self._view().with_state(model.name, ModelState.COLD)
        admitted = self.policy.admit(view)
        if model.name not in admitted.load:
            self.park(model, "room")
            return
        load = tuple(name for name in admitted.load if name != model.name)
        plan = self.policy.plan(Admitted(
            admitted.view.with_state(model.name, ModelState.WARM), admitted.park, load))
        self._apply(plan)
        readmitted = next(m for m in admitted.view.models if m.name == model.name)
        if model.pool.has_history:        # (a model warmed up unused has none to go by)
            read_ahead = self.policy.preload(readmitted, plan.slots[model.name])
            model.pool.preload(model.pool.most_used(read_ahead), wait=False)

    def release(self, name: str) -> None:
        """Another replica of a fleet serves the model now (mox.fleet): its weights and slots
        leave as soon as its running requests finish, as a drained turn's do. A pinned model
        stays, as does every model under a policy that keeps them all (all-resident);
        requests that still come wait for admission like a cold model's."""
        model = self.models.get(name)
        if (model is None or model.state != ModelState.WARM or model.settings.pin
                or self.policy.pins_models):
            return
        if self.engine.num_running(name):
            self._drain(model)
            return
        self.park(model, "released")
        self.replan()

    def park(self, model: ServedModel, why: str) -> None:
        """Take the model's weights and expert slots off the device (it runs no sequence; it
        may have some waiting, which wait for it to load again); `why` goes to the timeline."""
        assert model.state == ModelState.WARM and self.engine.num_running(model.name) == 0
        model.draining = False
        self.engine.set_draining(model.name, False)
        self.engine.set_weights(model.name, None)
        if model.decoder is not None:
            model.decoder.drop_graphs()          # (their memory back now, not at collection)
        model.decoder, model.state = None, ModelState.COLD
        self.residency.apply({model.name: 0})
        self._cold_starts_stale = True
        self.timeline.event(ModelEvent("park", self.clock(), model.name, why=why))

    # ---- memory ------------------------------------------------------------------------
    def replan(self) -> None:
        """Every pool's slots from the policy (admission is `_try_start_loads`'s), and how
        each cold model would start beside them."""
        self._apply(MemoryPlan(self.policy.plan_slots(self._view())))
        self._refresh_cold_starts()

    def _refresh_cold_starts(self) -> None:
        self._cold_starts_stale = False
        view = self._view()
        self._cold_starts = {m.name: self.policy.cold_start(view, m.name)
                             for m in view.models if m.state == ModelState.COLD}

    def _apply(self, plan: MemoryPlan) -> None:
        """Parks, then the slots of every pool (the plan counts the loads' dense bytes), then
        the loads: a whole-model load reads experts into slots it must already have."""
        for name in plan.park:
            self.park(self.models[name], "room")
        loading = [self.models[name] for name in plan.load]
        for model in loading:
            self._mark_loading(model)
        self._cold_starts_stale = True
        self._next_plan = self.clock() + self.config.plan_period_s
        self.residency.apply(plan.slots)
        if self.policy.plans_host_cache:
            self.residency.share_host_cache()
        for model in loading:
            # a pinned model is served whole: it is ready once all of it has landed
            self._begin_load(model, plan.preload.get(model.name, 0),
                             self.policy.streams_cold_starts and not model.settings.pin)

    def _view(self, whole_budget: bool = False) -> MemoryView:
        """The frozen view the memory policy plans from (mox.router.views); each busy model's
        run size in it is kept as its turn's (it only rises until the model goes idle). Its
        budget leaves out what removed models still hold while they load, unless
        `whole_budget` (whether a model can ever run as it is set up)."""
        budget = self.config.device_memory
        if budget is not None and not whole_budget:
            budget = max(0, budget - self.residency.closing_bytes())
        view = memory_view(self.models, budget, self.has_requests,
                           self.admission.oldest_arrival, self.clock(), self.timeline.costs)
        for m in view.models:
            turn = m.has_work and m.holds_device_memory
            self.models[m.name].turn_run_slots = m.run_slots if turn else 0
        return view

    # ---- reporting ---------------------------------------------------------------------
    def snapshot(self) -> dict:
        """The plan and every model's traffic, state and pager figures (for metrics)."""
        now = self.clock()
        return {"policy": self.config.policy, "device_budget_bytes": self.config.device_memory,
                "device_used_bytes": self.residency.used_bytes(),
                "models": {name: self._model_snapshot(m, now)
                           for name, m in list(self.models.items())}}

    def _model_snapshot(self, model: ServedModel, now: float) -> dict:
        out = {"state": model.state.value, "error": model.error,
               "running": self.engine.num_running(model.name),
               "waiting": self.engine.num_waiting(model.name),
               "request_rate": model.traffic.request_rate(now),
               "request_rates": list(model.traffic.request_rates(now)),
               "token_rate": model.traffic.token_rate(now),
               "dense_resident": model.state == ModelState.WARM,
               "dense_bytes": model.dense_nbytes, "num_loads": model.num_loads}
        if model.state == ModelState.COLD:
            start = self._cold_starts.get(model.name, ColdStart())
            out["cold_start"] = {"waits": start.waits, "parks": list(start.parks),
                                 "squeezes": dict(start.squeezes)}
        if model.pool is not None:
            pager = model.pool.stats()
            out["planned_slots"] = pager["num_slots"]
            out["pager"] = pager
        host_bytes = self.residency.host_cache_bytes(model.name)
        if host_bytes is not None:
            out["host_cache_bytes"] = host_bytes
        return out

    def shutdown(self) -> None:
        self._loader.shutdown()
        self.timeline.close()


def _open_step_log(path: str) -> IO[str]:
    try:
        return open(path, "a", encoding="utf-8")
    except OSError as e:
        raise InvalidRequestError(f"cannot write the step log {path}: {e.strerror}",
                                  param="step_log") from e
