import { Injectable, OnModuleDestroy } from '@nestjs/common';
import { randomUUID } from 'node:crypto';
import { mustActFor } from '../common/auth.js';
import { DomainError, ErrorCode, FieldError } from '../common/errors.js';
import { AppConfig } from '../config/app-config.js';
import { bodyHash } from '../common/stable-json.js';
import { PoolEntity } from '../database/entities.js';
import { MetricsService } from '../metrics/metrics.service.js';
import { PoolCatalog } from '../pools/pool-catalog.service.js';
import {
  HoldStore,
  ReserveRequest,
  ReserveResult,
  StoredReservation,
  WAIT_LINELESS_PAUSE_MS,
  waitingLine,
} from '../redis/hold-store.repository.js';
import { FreedItems, WakeUps } from '../redis/wake-ups.js';
import { makeReservationId, poolOfReservationId } from '../redis/keys.js';
import { CommitService, isLeaseCommit, notFound } from './commit.service.js';
import { ConfirmResultDto, CreateReservationDto, ReservationDto } from './reservation.dto.js';
import { committedReservationDto, toConfirmResult, toReservationDto } from './reservation.view.js';
import { monotonicMs } from '../common/clock.js';

/** An Idempotency-Key: 1-255 visible ASCII characters. */
export const IDEMPOTENCY_KEY = /^[\x21-\x7e]{1,255}$/;

/** What is wrong with an Idempotency-Key header, or null (none sent, or a good one). */
export function idempotencyKeyFault(key: string | string[] | undefined): FieldError | null {
  if (key === undefined || (typeof key === 'string' && IDEMPOTENCY_KEY.test(key))) return null;
  return { field: 'Idempotency-Key', reason: 'Idempotency-Key must be 1-255 visible ASCII characters' };
}

/**
 * A reserve with `waitMs` tries again after WAIT_FIRST_PAUSE_MS, the pause doubling up to WAIT_MAX_PAUSE_MS, each
 * wait drawn at random between the pause and 1.5 times it (so that waiters spread out): an item freed anywhere is
 * found within 1.5 × WAIT_MAX_PAUSE_MS (by a waiter with no line, while wake-ups are live, within 1.5 ×
 * WAIT_LINELESS_PAUSE_MS: see below), and a waiter costs Redis at most one reserve script per pause. Waiters take
 * their turn: the items a filter's waiters could use go to the one that began to wait first (reserve.lua, `line`).
 *
 * Waiters are woken when items come free in their pool (WakeUps): for each filter, the waiters on this instance with
 * that filter that the items matching it could serve, first fit in the order they began to wait (`wake`), try again
 * at once (at most WAKE_MAX_WAITERS a message in all; a message that gives only how many came free counts them all
 * for every filter), but at most every WAKE_MIN_GAP_MS. A waiter woken during a try tries again as soon as that try
 * ends. The first of a line is woken whatever its count (items free before may make up the rest): when its try finds
 * too few, the free items it reports the waiters ahead leave (reserve.lua, `spare`) wake the waiters behind it that
 * they could serve, first fit (`passOn`). A waiter that leaves its line unserved, its place live, tells the pool's
 * instances (HoldStore.leaveLine): each wakes its waiters of that line whose last try found items kept for waiters
 * ahead, first fit by the count of the one that left (`wakeBehind`). A waiter is not woken by one ahead that
 * stopped trying (its place lapses), nor while this instance is not subscribed: then it finds out on its next try.
 * While wake-ups are not live (the connection down, or the subscription not confirmed yet), the first waiter in line,
 * told it has no live waiter ahead, pauses at most WAIT_HEAD_PAUSE_MS (to 1.5 times it) whatever its backoff, so that
 * it tries again within 75 ms of their return; at most WAIT_MAX_HEADS waiters an instance pause so briefly (a client
 * may make every waiter the first of a line of its own, a filter each), the others keep their backoff. When the
 * connection is lost, those first in line are woken to start doing so.
 *
 * A waiter whose filter has several conditions (no line) backs off to WAIT_LINELESS_PAUSE_MS while wake-ups are live:
 * each try of it counts the free items that match every condition, a pass over the smallest of their sets in Redis
 * (28-45 ms with sets of 100,000), and 50 such waiters of a pool of 200,000 items, trying every 250-375 ms, held
 * Redis at 100 % for every client (a security review). Its tries mark the pool as waited in for as long as such a
 * pause (HoldStore, WAIT_LINELESS_PAUSE_MS), so that a free is published, and it is woken when matching items come
 * free; only a lost wake-up, or a free that wakes WAKE_MAX_WAITERS waiters before it, is found later (within 3 s).
 */
export const WAIT_FIRST_PAUSE_MS = 25;
export const WAIT_MAX_PAUSE_MS = 250;
export const WAIT_HEAD_PAUSE_MS = 50;
export const WAIT_MAX_HEADS = 64;
export const WAKE_MAX_WAITERS = 64;
export const WAKE_MIN_GAP_MS = 20;

/** A reserve waiting for free items on this instance. */
interface Waiter {
  /** Its filter, and a name shared by the waiters with the same filter. */
  filter: Pick<ReserveRequest, 'valuePrefix' | 'attributes'>;
  group: string;
  /** How many items it waits for. */
  count: number;
  /** Its last try found it first in its line. */
  first: boolean;
  /** Ends the pause under way, if any. */
  wake?: () => void;
  /** Woken while it was not pausing (a try under way): it tries again without a pause. */
  woken: boolean;
  /** Its last try found enough items but for those kept for waiters ahead of it in its line. */
  keptAhead: boolean;
  /** The number of its last try (ReservationsService.tries). */
  tried: number;
  /** Woken, and its next try not sent yet: woken again, it would try no sooner. */
  roused: boolean;
}

/**
 * Ends a waiter's pause, or, during a try, has it try again as soon as that try ends; false if it was woken already
 * and has not tried since (this changes nothing).
 */
function rouse(w: Waiter): boolean {
  if (w.roused) return false;
  w.roused = true;
  if (w.wake) w.wake();
  else w.woken = true;
  return true;
}

/** The waiters that began to wait after `me`, in that order. */
function* after(waiting: Iterable<Waiter>, me: Waiter): Generator<Waiter> {
  let behind = false;
  for (const w of waiting) {
    if (behind) yield w;
    else behind = w === me;
  }
}

/**
 * Of the waiters `which` selects, in the order they began to wait, each that `items` still serve is counted out of
 * them (first fit, as reserve.lua serves a line) and woken unless `saw` says it has tried since the items were
 * counted (it took them or was told why not); at most WAKE_MAX_WAITERS are woken. Returns how many.
 */
function wakeFirstFit(
  waiting: Iterable<Waiter>,
  items: number,
  which: (w: Waiter) => boolean,
  saw: (w: Waiter) => boolean = () => false,
): number {
  let woken = 0;
  for (const w of waiting) {
    if (items <= 0 || woken >= WAKE_MAX_WAITERS) break;
    if (!which(w) || w.count > items) continue;
    items -= w.count;
    if (!saw(w) && rouse(w)) woken++;
  }
  return woken;
}

/** Whether an item that came free matches a reserve's filter (as reserve.lua's `matches`). */
export function matchesFilter(item: { v: string; a?: Record<string, string> }, filter: Waiter['filter']): boolean {
  if (filter.valuePrefix && !item.v.startsWith(filter.valuePrefix)) return false;
  for (const [k, v] of Object.entries(filter.attributes ?? {})) {
    if (item.a?.[k] !== v) return false;
  }
  return true;
}

export interface ReserveAnswer {
  /** false when an Idempotency-Key replayed an earlier reservation (200 instead of 201). */
  created: boolean;
  reservation: ReservationDto;
}

/** Resolves the pool a reservation id belongs to. */
export async function poolOf(catalog: PoolCatalog, reservationId: string): Promise<PoolEntity> {
  const name = poolOfReservationId(reservationId);
  if (!name) throw notFound(reservationId);
  try {
    return await catalog.get(name);
  } catch (err) {
    if (err instanceof DomainError && err.code === ErrorCode.POOL_NOT_FOUND) throw notFound(reservationId);
    throw err;
  }
}

/** Checks a hold time against the pool; shared by reservations and task leases. */
export function holdTtl(pool: PoolEntity, requested: number | undefined, field: string): number {
  const ttl = requested ?? pool.holdTtlMs;
  if (ttl > pool.maxHoldTtlMs) {
    throw DomainError.validation([{ field, reason: `${field} must not be greater than the pool's maxHoldTtlMs (${pool.maxHoldTtlMs})` }]);
  }
  return ttl;
}

@Injectable()
export class ReservationsService implements OnModuleDestroy {
  /** Wakes the reserves waiting for free items (waitMs), with false: the instance is shutting down. */
  private readonly pauses = new Set<(goOn: boolean) => void>();
  /** Reserves waiting for free items now (AppConfig.MAX_WAITING_RESERVES). */
  private waiting = 0;
  /**
   * Tries of reserves that wait, numbered as they are sent: they go on one connection, so Redis runs them in this
   * order, and a try numbered after another saw what that one saw, or later (but for a script Redis lost, sent again
   * after its NOSCRIPT: that rare reorder costs a wake-up, never an item).
   */
  private tries = 0;
  /** Waiters first in their line, pausing briefly now (WAIT_MAX_HEADS). */
  private heads = 0;
  /** The waiters of each pool, in the order they began to wait, and how to stop listening for its freed items. */
  private readonly waiters = new Map<string, { waiting: Set<Waiter>; stop: () => void }>();
  private stopping = false;

  constructor(
    private readonly catalog: PoolCatalog,
    private readonly holds: HoldStore,
    private readonly committer: CommitService,
    private readonly metrics: MetricsService,
    private readonly config: AppConfig,
    private readonly wakeUps: WakeUps,
  ) {}

  /**
   * `gone`: the caller hung up: a reserve waiting for free items stops waiting, and one that held them meanwhile
   * gives them back.
   */
  async reserve(
    poolName: string,
    dto: CreateReservationDto,
    idempotencyKey: string | undefined,
    gone?: AbortSignal,
  ): Promise<ReserveAnswer> {
    const badKey = idempotencyKeyFault(idempotencyKey);
    if (badKey) throw DomainError.validation([badKey]);
    const pool = await this.catalog.get(poolName);
    const count = dto.count ?? 1;
    const request: ReserveRequest = {
      reservationId: makeReservationId(pool.name, randomUUID()),
      owner: dto.owner,
      count,
      ttlMs: holdTtl(pool, dto.ttlMs, 'ttlMs'),
      maxHoldsPerOwner: pool.maxHoldsPerOwner ?? 0,
      kind: 'r',
      idempotencyKey,
      bodyHash: idempotencyKey === undefined ? undefined : bodyHash(dto),
      attributes: dto.filter?.attributes,
      valuePrefix: dto.filter?.valuePrefix,
      groupAffinity: false,
    };
    const deadline = monotonicMs() + (dto.waitMs ?? 0);
    let result = await this.reserveOrWait(pool.name, request, dto.waitMs ?? 0, gone);
    while (result.status === 'landed') {
      // The key names a reservation whose record Redis lost: a rebuild put the key back from its commit in Postgres.
      const committed = await this.committer.landedCommit(result.reservationId);
      if (committed) {
        this.metrics.reservations.inc({ pool: pool.name, outcome: 'replay' });
        return { created: false, reservation: committedReservationDto(pool.name, result.reservationId, committed) };
      }
      // Neither Redis nor Postgres has it: the key is taken for a new reservation, as if it had expired.
      const waitMs = dto.waitMs ? Math.max(0, deadline - monotonicMs()) : 0;
      result = await this.reserveOrWait(pool.name, { ...request, forgotten: result.reservationId }, waitMs, gone);
    }
    this.metrics.reservations.inc({ pool: pool.name, outcome: result.status });
    switch (result.status) {
      case 'ok':
        return { created: true, reservation: toReservationDto(pool.name, result.reservation) };
      case 'replay':
        return { created: false, reservation: toReservationDto(pool.name, await this.settledView(pool, result.reservation)) };
      case 'exhausted':
        if (result.limited) {
          throw new DomainError(
            ErrorCode.POOL_EXHAUSTED,
            `fewer than ${count} free items match among the candidates looked at in pool "${pool.name}": this filter matches ` +
              'too rarely to be searched in full; narrow it (a longer valuePrefix, fewer attributes) or try again',
            { pool: pool.name, count, searchLimited: true },
          );
        }
        if (result.waitersAhead !== undefined) {
          throw new DomainError(
            ErrorCode.POOL_EXHAUSTED,
            `fewer than ${count} free items match in pool "${pool.name}" but for those kept for ${result.waitersAhead} ` +
              'reserves that began to wait for them before this one',
            { pool: pool.name, count, waitersAhead: result.waitersAhead },
          );
        }
        throw new DomainError(ErrorCode.POOL_EXHAUSTED, `fewer than ${count} free items match in pool "${pool.name}"`, {
          pool: pool.name,
          count,
        });
      case 'quota':
        throw new DomainError(
          ErrorCode.OWNER_QUOTA_EXCEEDED,
          `"${dto.owner}" holds ${result.held} items; the pool allows ${pool.maxHoldsPerOwner} per owner`,
          { held: result.held, maxHoldsPerOwner: pool.maxHoldsPerOwner },
        );
      case 'reused':
        throw new DomainError(ErrorCode.IDEMPOTENCY_KEY_REUSED, 'this Idempotency-Key was sent before with a different body', {
          idempotencyKey,
        });
    }
  }

  /**
   * Runs the reserve script until it holds the items or `waitMs` has passed. Each try is the same request (the
   * same reservation id: a try that finds too few items writes nothing), so all-or-nothing and the
   * Idempotency-Key hold as for one try; a key's replay or refusal, the owner's quota and a search cut short
   * (a filter that matches too rarely: trying again would cost as much and find as little) end the wait at once.
   */
  private reserveOrWait(pool: string, request: ReserveRequest, waitMs: number, gone?: AbortSignal): Promise<ReserveResult> {
    if (waitMs === 0) return this.holds.reserve(pool, request);
    return this.holds.whileOpen(this.waitFor(pool, request, waitMs, gone));
  }

  private async waitFor(pool: string, request: ReserveRequest, waitMs: number, gone?: AbortSignal): Promise<ReserveResult> {
    const most = this.config.MAX_WAITING_RESERVES;
    const tooMany = () =>
      new DomainError(
        ErrorCode.RATE_LIMITED,
        `${most} reserves are waiting for free items on this instance already; try again later, or with waitMs 0`,
        { waitingReserves: most },
      );
    if (this.waiting >= most) {
      // One try that takes no turn in the line, as waitMs 0 does; 429 if it finds too few.
      const once = await this.tryFor(pool, request, gone);
      if (once.status !== 'exhausted' || once.limited) return once;
      throw tooMany();
    }
    const waiter: ReserveRequest = { ...request, waits: true };
    let result: ReserveResult | undefined;
    let failed = false;
    try {
      const firstTry = ++this.tries;
      result = await this.tryFor(pool, waiter, gone);
      if (result.status !== 'exhausted' || result.limited) return result;
      if (this.waiting >= most) throw tooMany();
      const deadline = monotonicMs() + waitMs;
      this.waiting++;
      this.metrics.waitingReserves.inc();
      const filter = { valuePrefix: waiter.valuePrefix, attributes: waiter.attributes };
      const line = waitingLine(waiter);
      const me: Waiter = {
        filter,
        group: line === '' ? `~${JSON.stringify(filter)}` : line,
        count: waiter.count,
        first: false,
        woken: false,
        keptAhead: (result.waitersAhead ?? 0) > 0,
        tried: firstTry,
        roused: false,
      };
      let stopWaiting = (): void => undefined;
      let head = false;
      let triedAt = monotonicMs();
      try {
        stopWaiting = this.startWaiting(pool, me);
        const longest = () => (line === '' && this.wakeUps.live(pool) ? WAIT_LINELESS_PAUSE_MS : WAIT_MAX_PAUSE_MS);
        for (let pause = WAIT_FIRST_PAUSE_MS; ; pause = Math.min(2 * pause, longest())) {
          if (this.stopping) throw DomainError.shuttingDown();
          const left = deadline - monotonicMs();
          if (left <= 0 || gone?.aborted) return result;
          me.first = result.status === 'exhausted' && result.inLine === 0;
          const first = me.first && !this.wakeUps.live(pool);
          if (first !== head && (!first || this.heads < WAIT_MAX_HEADS)) {
            head = first;
            this.heads += head ? 1 : -1;
            this.metrics.waitingFirstInLine.set(this.heads);
          }
          const next = head ? Math.min(pause, WAIT_HEAD_PAUSE_MS) : pause;
          if (me.woken) me.woken = false;
          else if (!(await this.pause(Math.min(left, next + Math.random() * (next / 2)), gone, me))) {
            throw DomainError.shuttingDown();
          }
          // Woken at every free (items taken by others, or kept for waiters ahead), it still tries at most so often.
          const early = Math.min(triedAt + WAKE_MIN_GAP_MS, deadline) - monotonicMs();
          if (early > 0) await new Promise((resolve) => setTimeout(resolve, early));
          if (this.stopping) throw DomainError.shuttingDown();
          if (gone?.aborted) return result;
          triedAt = monotonicMs();
          me.tried = ++this.tries;
          me.roused = false;
          result = await this.tryFor(pool, waiter, gone);
          if (result.status !== 'exhausted' || result.limited) return result;
          me.keptAhead = (result.waitersAhead ?? 0) > 0;
          if (result.spare) this.passOn(pool, me, result.spare);
        }
      } finally {
        stopWaiting();
        this.waiting--;
        if (head) this.metrics.waitingFirstInLine.set(--this.heads);
        this.metrics.waitingReserves.dec();
      }
    } catch (err) {
      failed = true;
      throw err;
    } finally {
      // Served, it left the line in the script; otherwise it leaves it before it answers (a caller trying again at
      // once, on any instance, must not find itself ahead). An error (a 503 from Redis or at shutdown, a 429) goes
      // first: the leave, sent now, reaches Redis before this instance's connection to it closes (whileOpen), and a
      // place it fails to take out is passed over once it lapses.
      if (result?.status !== 'ok') {
        const left = this.holds.leaveLine(pool, waiter);
        if (!failed) await left;
      }
    }
  }

  /** Counts `me` among the pool's waiters, to be woken when its items come free, until the function returned is called. */
  private startWaiting(pool: string, me: Waiter): () => void {
    let entry = this.waiters.get(pool);
    if (!entry) {
      const waiting = new Set<Waiter>();
      const listener = {
        freed: (freed: FreedItems) => this.wake(waiting, freed),
        left: (line: string, count: number) => this.wakeBehind(waiting, line, count),
        // Not woken from now on: those first in line try again now, and as often as WAIT_HEAD_PAUSE_MS from then on.
        lost: () => waiting.forEach((w) => w.first && w.wake?.()),
      };
      entry = { waiting, stop: this.wakeUps.listen(pool, listener) };
      this.waiters.set(pool, entry);
    }
    entry.waiting.add(me);
    return () => {
      const now = this.waiters.get(pool);
      if (!now?.waiting.delete(me) || now.waiting.size > 0) return;
      this.waiters.delete(pool);
      now.stop();
    };
  }

  /**
   * Items came free in the pool of these waiters. For each filter, its waiters in the order they began to wait, first
   * fit as reserve.lua serves them: each that the matching items left can serve is woken and counted out of them; the
   * first is woken whatever its count (items free before may make up the rest), counted out only if they serve it.
   */
  private wake(waiting: Set<Waiter>, freed: FreedItems): void {
    const usable = new Map<string, number>();
    let woken = 0;
    for (const w of waiting) {
      const seen = usable.get(w.group);
      const left = seen ?? (freed.items ? freed.items.filter((item) => matchesFilter(item, w.filter)).length : freed.count);
      if (left === 0 || (seen !== undefined && w.count > left)) continue;
      usable.set(w.group, w.count <= left ? left - w.count : left);
      if (rouse(w) && ++woken >= WAKE_MAX_WAITERS) break;
    }
    if (woken > 0) this.metrics.waitersWoken.inc(woken);
  }

  /**
   * A try of `me` found too few items, `spare` of them left by the waiters ahead of it: the waiters of its line behind
   * it on this instance that those could serve, first fit, are woken (the items that came free alone may not have
   * served them, and so not woken them); those whose last try came after its own are counted, not woken (they saw as
   * much).
   */
  private passOn(pool: string, me: Waiter, spare: number): void {
    const waiting = this.waiters.get(pool)?.waiting;
    if (!waiting) return;
    const woken = wakeFirstFit(
      after(waiting, me),
      spare,
      (w) => w.group === me.group,
      (w) => w.tried > me.tried,
    );
    if (woken > 0) this.metrics.waitersWoken.inc(woken);
  }

  /**
   * A waiter for `count` items left the line `line` unserved, maybe with items kept for it: the waiters of that line
   * on this instance whose last try found items kept for waiters ahead are woken, first fit by `count`, and so are those
   * with a try under way (its answer may come after this message, and say so): they try again when it ends.
   */
  private wakeBehind(waiting: Set<Waiter>, line: string, count: number): void {
    const woken = wakeFirstFit(waiting, count, (w) => w.group === line && (w.keptAhead || !w.wake));
    if (woken > 0) this.metrics.waitersWoken.inc(woken);
  }

  /**
   * One try of a reserve that may wait. Should its caller have hung up while the script ran and held the items,
   * they are given back (as the undo of a reserve that got no answer: a reservation that a keyed request was
   * answered with stays), and the caller, gone, is answered that none were free.
   */
  private async tryFor(pool: string, request: ReserveRequest, gone?: AbortSignal): Promise<ReserveResult> {
    const result = await this.holds.reserve(pool, request);
    if (result.status !== 'ok' || !gone?.aborted) return result;
    await this.holds.giveBack(pool, request);
    return { status: 'exhausted', limited: false };
  }

  /**
   * Resolves true after `ms`, or at once when the caller hangs up or items come free (`me` woken); false when the
   * instance shuts down.
   */
  private pause(ms: number, gone: AbortSignal | undefined, me: Waiter): Promise<boolean> {
    if (this.stopping) return Promise.resolve(false);
    return new Promise((resolve) => {
      const done = (goOn: boolean): void => {
        clearTimeout(timer);
        gone?.removeEventListener('abort', hungUp);
        this.pauses.delete(done);
        me.wake = undefined;
        resolve(goOn);
      };
      me.wake = () => done(true);
      const hungUp = (): void => done(true);
      const timer = setTimeout(hungUp, ms);
      gone?.addEventListener('abort', hungUp);
      this.pauses.add(done);
    });
  }

  /** Runs before the HTTP server closes (Nest calls onModuleDestroy first): waiting reserves answer 503 at once. */
  onModuleDestroy(): void {
    this.stopping = true;
    for (const wake of [...this.pauses]) wake(false);
  }

  /**
   * For a key bound to an owner (`actingFor`): 403 FORBIDDEN unless the reservation (`kind` 'r') or the lease ('l') is
   * that owner's; 404 for one of the other kind (owners and reviewers share one space of names). Read before the call
   * acts: a reservation's owner and kind never change. An unknown one is left to the call (404). No bound key
   * (`actingFor` undefined): nothing to check.
   */
  async mustOwn(id: string, kind: 'r' | 'l', actingFor: string | undefined): Promise<void> {
    if (actingFor === undefined) return;
    const pool = await poolOf(this.catalog, id);
    // (Not waiting for the check of a new connection to Redis: the call that acts next does.)
    const stored = await this.holds.peek(pool.name, id);
    const committed = stored ? null : await this.committer.landedCommit(id);
    const found = stored
      ? { owner: stored.owner, kind: stored.kind }
      : committed && { owner: committed.owner, kind: isLeaseCommit(committed) ? 'l' : 'r' };
    if (!found) return;
    if (found.kind !== kind) throw notFound(id);
    mustActFor(actingFor, found.owner);
  }

  async get(id: string): Promise<ReservationDto> {
    const pool = await poolOf(this.catalog, id);
    const stored = await this.holds.read(pool.name, id);
    // A task lease is no reservation, as a reservation is no lease to the task calls: unknown here (404).
    if (stored) {
      if (stored.kind !== 'r') throw notFound(id);
      return toReservationDto(pool.name, await this.settledView(pool, stored));
    }
    const committed = await this.committer.landedCommit(id, 'r');
    if (committed) return committedReservationDto(pool.name, id, committed);
    throw notFound(id);
  }

  /**
   * A reservation in the middle of a commit (pinned, or held again after a commit that got no answer) may be
   * confirmed in Postgres already (its Redis step failed, or is on its way): then it is finished now, and shown
   * confirmed. Shown as Redis has it when Postgres cannot be asked.
   */
  private async settledView(pool: PoolEntity, r: StoredReservation): Promise<StoredReservation> {
    if (r.epoch === 0 || (r.state !== 'confirming' && r.state !== 'held')) return r;
    const landed = await this.committer.finishIfLanded(pool, r.id).catch(() => null);
    return (landed && (await this.holds.read(pool.name, r.id))) || r;
  }

  async extend(id: string, ttlMs: number): Promise<ReservationDto> {
    const pool = await poolOf(this.catalog, id);
    const stored = await this.extendHold(pool, id, ttlMs, 'r');
    return toReservationDto(pool.name, stored);
  }

  /**
   * Extend ('r') and heartbeat ('l'): expiresAt = now + ttl, capped by the pool's maxHoldTtlMs. A record of the other
   * kind is unknown to it (404).
   */
  async extendHold(pool: PoolEntity, id: string, ttlMs: number, kind: 'r' | 'l'): Promise<StoredReservation> {
    const result = await this.holds.extend(pool.name, id, Math.min(ttlMs, pool.maxHoldTtlMs), kind);
    switch (result.status) {
      case 'extended':
        return result.reservation;
      case 'expired':
        throw new DomainError(ErrorCode.HOLD_EXPIRED, 'the hold has expired', { id });
      case 'confirming':
        throw confirmInProgress(id);
      case 'closed':
        throw new DomainError(ErrorCode.RESERVATION_CLOSED, 'the reservation is already confirmed or released', { id });
      case 'missing':
        // Redis no longer has it (retention over, or a wipe): a confirmed one is still known to Postgres.
        if (await this.committer.landedCommit(id, kind)) {
          throw new DomainError(ErrorCode.RESERVATION_CLOSED, 'the reservation is confirmed', { id });
        }
        throw notFound(id);
    }
  }

  async confirm(id: string, resourceIds: string[]): Promise<ConfirmResultDto> {
    const pool = await poolOf(this.catalog, id);
    const outcome = await this.committer.commit(pool, id, resourceIds, 'r');
    return toConfirmResult(id, outcome);
  }

  async release(id: string): Promise<ReservationDto> {
    const pool = await poolOf(this.catalog, id);
    return toReservationDto(pool.name, await this.releaseHold(pool, id, 'r'));
  }

  /** DELETE ('r') and abandon ('l'): a record of the other kind is unknown to it (404). */
  async releaseHold(pool: PoolEntity, id: string, kind: 'r' | 'l'): Promise<StoredReservation> {
    let result = await this.holds.release(pool.name, id, undefined, kind);
    if (result.status === 'undecided') {
      // A confirm of it failed without an answer from Postgres: settle that commit first. Landed: the
      // reservation is confirmed now, and the release answers so. Given up: the release goes ahead.
      await this.committer.settle(pool, id, result.epoch);
      result = await this.holds.release(pool.name, id, result.epoch, kind);
    }
    switch (result.status) {
      case 'released':
        return result.reservation;
      case 'confirmed':
        throw new DomainError(ErrorCode.RESERVATION_CLOSED, 'the reservation is confirmed; release its items one by one instead', {
          id,
        });
      case 'undecided':
      case 'busy':
        throw confirmInProgress(id);
      case 'missing': {
        if (await this.committer.landedCommit(id, kind)) {
          throw new DomainError(ErrorCode.RESERVATION_CLOSED, 'the reservation is confirmed', { id });
        }
        throw notFound(id);
      }
    }
  }
}

/**
 * RESERVATION_CLOSED while a confirm of the reservation commits: `details.confirmInProgress` tells it from a closed
 * one, since the reservation is held again if that confirm fails.
 */
function confirmInProgress(id: string): DomainError {
  return new DomainError(
    ErrorCode.RESERVATION_CLOSED,
    'a confirm of this reservation is in progress; once it ends the reservation is confirmed, or held again if it failed',
    { id, confirmInProgress: true },
  );
}
