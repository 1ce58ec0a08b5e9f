import { Injectable, Logger } from '@nestjs/common';
import { AppConfig } from '../config/app-config.js';
import { DomainError, ErrorCode } from '../common/errors.js';
import { PoolEntity, RESOURCE_ALLOCATED } from '../database/entities.js';
import { CommitRepository } from '../database/commit.repository.js';
import { ResourceRepository } from '../database/resource.repository.js';
import { GenerationRepository } from '../database/generation.repository.js';
import {
  AllocatedItem,
  CachedItem,
  HoldStore,
  KeyedReservation,
  Pinned,
  StoredReservation,
  compareIds,
  toCachedItem,
} from '../redis/hold-store.repository.js';
import { MetricsService } from '../metrics/metrics.service.js';
import { BatchWaitTimeout } from '../database/batcher.js';
import { Later } from '../common/later.js';

/** Landed commits whose Redis step this instance keeps to send again, at most (see finishQuietly). */
const MAX_UNFINISHED = 10_000;

/** What a confirm or task completion committed; stored in Postgres and Redis so every retry answers the same. */
export interface CommitOutcome {
  selection: string[];
  allocated: AllocatedItem[];
  released: string[];
  owner: string;
  items: CachedItem[];
  expiresMs: number;
  /** A reservation ("r") or a task lease ("l"); absent in commits recorded before it was kept. */
  kind?: 'r' | 'l';
  /**
   * The Idempotency-Key the reservation was made with, and when (Redis clock): a rebuild after a wipe puts the key
   * back until IDEMPOTENCY_TTL_MS after that, so that a retry of the reserve still answers with this reservation.
   * Absent for a reservation made without one, and in commits recorded before it was kept.
   */
  idempotency?: KeyedReservation;
}

/**
 * Whether a commit is a task lease's completion. A commit recorded before its kind was kept says nothing: one
 * of a single item is taken for a lease (a reservation made through /reservations on a task pool may hold one).
 */
export function isLeaseCommit(outcome: CommitOutcome): boolean {
  return outcome.kind === undefined ? outcome.items.length === 1 : outcome.kind === 'l';
}

/**
 * Confirm and task completion: pin the holds in Redis (starting a commit epoch), commit with the
 * version-checked UPDATE in one Postgres transaction that also records the epoch's decision, then
 * release the rest in Redis. Postgres' version check fences stale holds; the decision row fences a
 * commit against the sweeper giving the same attempt up.
 */
@Injectable()
export class CommitService {
  private readonly logger = new Logger(CommitService.name);

  constructor(
    private readonly holds: HoldStore,
    private readonly resources: ResourceRepository,
    private readonly commits: CommitRepository,
    private readonly metrics: MetricsService,
    private readonly config: AppConfig,
    private readonly generations: GenerationRepository,
  ) {}

  /**
   * `kind`: a confirm acts on reservations ('r'), a task complete on leases ('l'): one of the other kind is unknown to
   * it (404). `decidedEpoch`: this is the one more try of a commit whose epoch Postgres ended before it landed (the
   * sweeper gave it up while the commit was slow, or another attempt of it got no answer): its pin must not join that
   * epoch.
   */
  async commit(
    pool: PoolEntity,
    reservationId: string,
    resourceIds: string[],
    kind: 'r' | 'l',
    decidedEpoch?: number,
  ): Promise<CommitOutcome> {
    const selection = [...resourceIds].sort(compareIds);
    const pin = await this.holds.pin(pool.name, reservationId, selection, this.config.COMMIT_WINDOW_MS, decidedEpoch, kind);
    switch (pin.status) {
      case 'missing': {
        // Redis no longer knows it (wiped, or retention over): Postgres knows every commit.
        const committed = await this.landedCommit(reservationId, kind);
        if (committed) return sameSelection(committed, selection);
        throw notFound(reservationId);
      }
      case 'closed':
        throw new DomainError(ErrorCode.RESERVATION_CLOSED, 'the reservation was released', { reservationId });
      case 'notin':
        throw new DomainError(ErrorCode.NOT_IN_RESERVATION, `resource ${pin.resourceId} is not held by this reservation`, {
          resourceId: pin.resourceId,
        });
      case 'lost':
        this.metrics.confirmConflicts.inc({ reason: 'hold_taken' });
        throw holdLost([pin.resourceId], 'held_by_another');
      case 'confirmed':
        return sameSelection(pin.reservation.outcome as unknown as CommitOutcome, selection);
      case 'pinned':
        return this.allocate(pool, selection, decidedEpoch !== undefined, pin);
    }
  }

  /** `pin`: what the pin returned: the reservation, and what unpin needs should this attempt fail before Postgres. */
  private async allocate(pool: PoolEntity, selection: string[], again: boolean, pin: Pinned): Promise<CommitOutcome> {
    const r = pin.reservation;
    const chosen = new Set(selection);
    const picked = r.items.filter((i) => chosen.has(i.id)).sort((a, b) => compareIds(a.id, b.id));
    const outcome: CommitOutcome = {
      selection,
      allocated: picked.map((i) => ({ resourceId: i.id, value: i.v, version: i.n + 1 })),
      released: r.items.filter((i) => !chosen.has(i.id)).map((i) => i.id),
      owner: r.owner,
      items: r.items,
      expiresMs: r.expiresMs,
      kind: r.kind,
      ...(pin.idempotency && { idempotency: { ...pin.idempotency, createdMs: r.createdMs } }),
    };
    const allocation = {
      poolId: pool.id,
      owner: r.owner,
      reservationId: r.id,
      epoch: r.epoch,
      generation: r.generation,
      items: picked.map((i) => ({ id: i.id, version: i.n })),
      body: JSON.stringify(outcome),
    };
    let result;
    let firstFailure: unknown;
    try {
      result = await this.resources.allocate(allocation).catch((err: unknown) => {
        // A lost connection (a Postgres restart, a session ended while this process was paused): try once
        // more on a fresh one. Safe: if the first attempt did commit, the epoch's decision row says so.
        if (!(err instanceof DomainError && err.code === ErrorCode.DEPENDENCY_UNAVAILABLE)) throw err;
        firstFailure = err;
        return this.resources.allocate(allocation);
      });
    } catch (err) {
      // This attempt joined an epoch that another attempt of the same confirm opened (the caller's retry, sent while
      // that one was committing). That one may still land: ending the epoch here would make it fail in its turn, and
      // should a third attempt join its next epoch and fail too, it would answer 409 HOLD_LOST with its hold intact.
      // So the epoch is left to its opener (or the sweeper, at the window's end), Redis as it is, and this answer
      // says what Postgres says now: landed, or not known yet. Unless no other attempt can land it (Postgres has
      // ended it already: that attempt failed too); then this attempt settles as an opener does. (A pin that has to
      // take an item back opens a new epoch, and a pin sent twice whose first run opened the epoch reports it opened:
      // pin.lua.)
      if (!pin.opened) {
        const other = await this.joinedEpoch(r.id, r.epoch);
        if (other.landed) return this.answerLanded(pool, r.id, other.landed, selection);
        if (!other.ended) {
          if (!(err instanceof DomainError && err.code === ErrorCode.DEPENDENCY_UNAVAILABLE)) throw err;
          throw outcomeUnknown(err, 'another attempt of this confirm, which this one joined, may still commit it');
        }
      }
      // No answer from Postgres, but the commit may have landed all the same (its answer late, or lost with the
      // connection). Postgres ends the epoch now, waiting for a commit of it in flight, so that the answer is true:
      // landed, the confirm succeeded; given up, nothing was changed, and this attempt can no longer land.
      const settled = await this.endEpochs(r.id, r.epoch).then(
        (landed) => ({ landed }),
        () => null,
      );
      if (settled?.landed) {
        return this.answerLanded(pool, r.id, settled.landed, selection);
      }
      // Held again until its expiry, so the caller's retry can still succeed (in a new epoch). Should the commit
      // have landed unseen after all, the sweeper finds its decision row at expiry and finishes it. If this attempt
      // cannot land (it surely never reached Postgres, or Postgres has just ended its epoch), the 503 says nothing
      // was changed: Redis is put back as it was before the pin, as far as it can be (unpin.lua).
      const maybeSent = mayHaveReachedPostgres(err) || (firstFailure !== undefined && mayHaveReachedPostgres(firstFailure));
      await this.holds.unpin(pool.name, pin, settled !== null || !maybeSent, settled !== null).catch(() => false);
      if (settled === null && maybeSent) throw outcomeUnknown(err);
      throw err;
    }
    if (result === 'committed') {
      await this.finishQuietly(pool, r.id, outcome, allocation.body);
      return outcome;
    }
    // Someone ended this reservation's commit first: the same confirm on another instance, or the sweeper.
    const committed = await this.landedCommit(r.id);
    if (committed) {
      return this.answerLanded(pool, r.id, committed, selection);
    }
    if (result === 'decided') {
      // Postgres ended this epoch before the commit got there, and nothing landed: the commit outlasted its window
      // (Postgres slow) and the sweeper gave the epoch up, or another confirm that joined it got no answer and gave
      // it up (see the catch above). The hold may well be due still, and API.md promises such a confirm success:
      // once more, in a new epoch (never the ended one, though its window may still be open). Its items are still
      // this reservation's unless its hold ran out and someone took them (then HOLD_LOST, as it should be).
      if (!again) return this.commit(pool, r.id, selection, r.kind, r.epoch);
      this.metrics.confirmConflicts.inc({ reason: 'commit_window_passed' });
      // Nobody took the items: Postgres was too slow, twice. HOLD_LOST would tell the caller to give up.
      throw new DomainError(
        ErrorCode.DEPENDENCY_UNAVAILABLE,
        'postgres is too slow: the commit took longer than its window, twice, and was given up; nothing was changed ' +
          '(send the confirm again while the hold is due)',
        { dependency: 'postgres', resourceIds: selection },
      );
    }
    this.metrics.confirmConflicts.inc({ reason: 'version_changed' });
    // An earlier commit epoch of this reservation may have landed after all (its caller had given up on it).
    const landed = await this.endEpochs(r.id, r.epoch);
    if (landed) {
      return this.answerLanded(pool, r.id, landed, selection);
    }
    await this.abortWithTruth(pool, r);
    const rows = await this.resources.findMany(pool.id, selection);
    const generation = await this.generations.current();
    const err = holdLost(selection, 'version_changed');
    Object.assign(err.details, {
      found: rows.map((row) => ({ id: row.id, state: row.state, version: row.version })),
      held: picked.map((i) => ({ id: i.id, version: i.n })),
      generation: { held: r.generation, current: generation },
    });
    throw err;
  }

  /** A commit Postgres has for the reservation: its Redis step sent (see finishQuietly), and the answer for `selection`. */
  private async answerLanded(pool: PoolEntity, reservationId: string, landed: CommitOutcome, selection: string[]): Promise<CommitOutcome> {
    await this.finishQuietly(pool, reservationId, landed);
    return sameSelection(landed, selection);
  }

  /**
   * What Postgres says, without deciding anything, of an epoch this instance's attempt joined and got no answer
   * for (see allocate): its commit, if one landed; `ended`, if it was given up. Neither when Postgres cannot say.
   */
  private async joinedEpoch(reservationId: string, epoch: number): Promise<{ landed?: CommitOutcome; ended?: boolean }> {
    try {
      if ((await this.resources.decisionOf(reservationId, epoch)) === 'abort') return { ended: true };
      return { landed: (await this.landedCommit(reservationId)) ?? undefined };
    } catch {
      return {};
    }
  }

  /**
   * The reservation's commit as Postgres recorded it, or null. Its allocated items are rebuilt field by field:
   * jsonb keeps an object's keys in an order of its own, and an answer from this commit (a repeated confirm, the
   * record finish writes back to Redis) must have the same bytes as the first. `kind`: only a reservation's ('r') or a
   * lease's ('l') commit; null for one that records the other kind (one recorded before commits kept their kind passes
   * as either: a one-item reservation's could not be told from a lease's).
   */
  async landedCommit(reservationId: string, kind?: 'r' | 'l'): Promise<CommitOutcome | null> {
    const row = await this.commits.find(reservationId);
    if (!row) return null;
    const outcome = row.body as unknown as CommitOutcome;
    if (kind !== undefined && outcome.kind !== undefined && outcome.kind !== kind) return null;
    return { ...outcome, allocated: outcome.allocated.map(({ resourceId, value, version }) => ({ resourceId, value, version })) };
  }

  /**
   * Postgres ends the reservation's commit epochs up to `epoch` (see ResourceRepository.decideAbort).
   * Returns the commit if one of them landed, null if they are all given up now.
   */
  private async endEpochs(reservationId: string, epoch: number): Promise<CommitOutcome | null> {
    if ((await this.resources.decideAbort(reservationId, epoch)) === 'abort') return null;
    return this.landedCommit(reservationId);
  }

  /** `json`: the outcome as JSON text, when the caller has it already. */
  private finish(pool: PoolEntity, reservationId: string, outcome: CommitOutcome, json = JSON.stringify(outcome)): Promise<number> {
    return this.holds.finish(pool.name, reservationId, outcome.allocated, json);
  }

  /**
   * The commit is durable in Postgres; if Redis fails now, the sweeper's upkeep sends the finish again as soon as
   * Redis takes it (retryFinishes): until then the items the confirm released stay held, and the reservation
   * reads as held. (Past MAX_UNFINISHED, or should this instance die, the sweeper finishes it from the commit row
   * once its commit window is over.)
   */
  private async finishQuietly(pool: PoolEntity, reservationId: string, outcome: CommitOutcome, json?: string): Promise<void> {
    try {
      await this.finish(pool, reservationId, outcome, json);
    } catch (err) {
      this.logger.warn(`commit of ${reservationId} is durable, its Redis step is sent again later: ${String(err)}`);
      this.unfinished.add(reservationId, { pool, reservationId, outcome, json });
    }
  }

  /** Landed commits whose Redis step failed, by reservation id (see finishQuietly). */
  private readonly unfinished = new Later<{ pool: PoolEntity; reservationId: string; outcome: CommitOutcome; json?: string }>(
    MAX_UNFINISHED,
  );

  /** Sends the Redis steps of landed commits that failed again; run by the sweeper's upkeep. Returns how many went. */
  retryFinishes(): Promise<number> {
    return this.unfinished.retry(({ pool, reservationId, outcome, json }) => this.finish(pool, reservationId, outcome, json));
  }

  /**
   * Finishes in Redis the reservation's commit if Postgres has it (its Redis step failed, or is on its way), so that
   * what Redis shows catches up at once; returns that commit, or null.
   */
  async finishIfLanded(pool: PoolEntity, reservationId: string): Promise<CommitOutcome | null> {
    const landed = await this.landedCommit(reservationId);
    if (landed) await this.finish(pool, reservationId, landed);
    return landed;
  }

  /**
   * Settles a reservation whose commit epoch Postgres recorded as aborted, with what Postgres says about
   * its items now: allocated ones stay out of the pool, the others go back (or stay held while the hold is due).
   */
  private async abortWithTruth(pool: PoolEntity, r: StoredReservation): Promise<'held' | 'expired' | 'stale'> {
    for (let attempt = 1; ; attempt++) {
      // Stamped before the read: Redis refuses what a read that is too old says (this instance stalled after it).
      const readAt = await this.holds.clock();
      const rows = await this.resources.findMany(
        pool.id,
        r.items.map((i) => i.id),
      );
      const byId = new Map(rows.map((row) => [row.id, row]));
      const allocated: { id: string; version: number }[] = [];
      const fresh: CachedItem[] = [];
      for (const item of r.items) {
        const row = byId.get(item.id);
        if (row?.state === RESOURCE_ALLOCATED) allocated.push({ id: item.id, version: row.version });
        else if (row && row.version !== item.n) fresh.push(toCachedItem(row));
      }
      const how = await this.holds.abort(pool.name, r.id, r.epoch, readAt, allocated, fresh);
      if (how !== 'tooOld') return how;
      if (attempt === 3) {
        // Nothing changed in Redis; the caller may retry (a confirm answers 503, the sweeper tries again).
        throw DomainError.unavailable(
          'redis',
          new Error(`settling the commit of ${r.id}: Postgres' answer reached Redis too late three times`),
        );
      }
    }
  }

  /**
   * Before a reservation that once started a commit is released: Postgres decides its epochs. A commit
   * that landed unseen is finished now (the reservation is then confirmed in Redis); otherwise every
   * epoch is given up, so none can land after the release.
   */
  async settle(pool: PoolEntity, reservationId: string, epoch: number): Promise<void> {
    const landed = await this.endEpochs(reservationId, epoch);
    if (landed) await this.finish(pool, reservationId, landed);
  }

  /**
   * Sweeper hand-off: a reservation whose commit window ran out (its instance died or stalled), or an
   * expired one that once started a commit. Postgres decides: finish it if the commit landed, else give
   * the epoch up, so a commit still in flight can no longer land.
   */
  async recoverStalled(pool: PoolEntity, reservationId: string): Promise<'finished' | 'held' | 'expired' | 'gone'> {
    const r = await this.holds.read(pool.name, reservationId);
    if (!r || (r.state !== 'confirming' && r.state !== 'held') || r.epoch === 0) return 'gone';
    // Pinned again since it was found stalled: that confirm's epoch is live. Only the earlier ones are given
    // up (one of them may have landed after all), and Redis is left to the live confirm.
    const live = r.state === 'confirming' && r.pinnedUntilMs > r.nowMs;
    const lastToEnd = live ? r.epoch - 1 : r.epoch;
    const landed = lastToEnd > 0 ? await this.endEpochs(r.id, lastToEnd) : null;
    if (landed) {
      await this.finish(pool, r.id, landed);
      return 'finished';
    }
    if (live) return 'held';
    const how = await this.abortWithTruth(pool, r);
    return how === 'stale' ? 'gone' : how;
  }
}

function sameSelection(outcome: CommitOutcome, selection: string[]): CommitOutcome {
  if (outcome.selection.length === selection.length && outcome.selection.every((id, i) => id === selection[i])) return outcome;
  throw new DomainError(ErrorCode.RESERVATION_CLOSED, 'the reservation was already confirmed with a different selection', {
    confirmed: outcome.selection,
  });
}

/**
 * False when a failed commit surely never reached Postgres: it waited too long for a batch, or no connection
 * could be made (errors only a connection attempt gives: refused, no such host). Otherwise (a timeout, a
 * connection lost mid-way, a host unreachable, which an open connection may report after its query went out) it
 * may have landed. A commit that surely did not is undone in Redis as if it never came (unpin.lua).
 */
function mayHaveReachedPostgres(err: unknown): boolean {
  const cause = (err as { cause?: unknown } | null)?.cause ?? err;
  if (cause instanceof BatchWaitTimeout) return false;
  const code = (cause as { code?: unknown } | null)?.code;
  if (code === 'ECONNREFUSED' || code === 'ENOTFOUND' || code === 'EAI_AGAIN') return false;
  return !/timeout exceeded when trying to connect/.test(String((cause as { message?: unknown } | null)?.message));
}

/**
 * A 503 whose commit may have landed: Postgres could not be asked, or another attempt of the same confirm may still
 * land it (`why`). API.md's "nothing was changed" is not known.
 */
function outcomeUnknown(cause: unknown, why = 'the commit may have landed'): DomainError {
  const err = new DomainError(
    ErrorCode.DEPENDENCY_UNAVAILABLE,
    `postgres did not answer, and ${why}: send the same confirm again to learn its outcome (it is idempotent)`,
    { dependency: 'postgres', outcome: 'unknown' },
  );
  (err as { cause?: unknown }).cause = cause;
  return err;
}

function holdLost(resourceIds: string[], reason: 'held_by_another' | 'version_changed'): DomainError {
  return new DomainError(ErrorCode.HOLD_LOST, 'an item of the reservation was taken by someone else; nothing was allocated', {
    resourceIds,
    reason,
  });
}

export function notFound(reservationId: string): DomainError {
  return new DomainError(ErrorCode.RESERVATION_NOT_FOUND, 'no such reservation', { id: reservationId });
}
