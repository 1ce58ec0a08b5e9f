import { Injectable, Logger } from '@nestjs/common';
import { AppConfig } from '../config/app-config.js';
import { DomainError, ErrorCode } from '../common/errors.js';
import { PoolEntity, RESOURCE_ALLOCATED } from '../database/entities.js';
import { CommitRepository } from '../database/commit.repository.js';
import { ResourceRepository } from '../database/resource.repository.js';
import { CachedItem, HoldStore, StoredReservation, compareIds } from '../redis/hold-store.repository.js';
import { MetricsService } from '../metrics/metrics.service.js';
import { toCachedItem } from '../pools/pools.service.js';

/** What a confirm or task completion committed; stored in Postgres and Redis so every retry answers the same. */
export interface CommitOutcome {
  selection: string[];
  allocated: { resourceId: string; value: string; version: number }[];
  released: string[];
  owner: string;
  items: CachedItem[];
  expiresMs: number;
}

/**
 * Confirm and task completion: pin the holds in Redis, commit with the version-checked UPDATE in one
 * Postgres transaction, then release the rest in Redis. Postgres' version check is the fence: a hold
 * that was lost or went stale can never allocate.
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
  ) {}

  async commit(pool: PoolEntity, reservationId: string, resourceIds: string[]): Promise<CommitOutcome> {
    const selection = [...resourceIds].sort(compareIds);
    const pin = await this.holds.pin(pool.name, reservationId, selection, this.config.COMMIT_WINDOW_MS);
    switch (pin.status) {
      case 'missing': {
        // Redis no longer knows it (wiped, or retention over): Postgres knows every commit.
        const row = await this.commits.find(reservationId);
        if (row) return sameSelection(row.body as unknown as CommitOutcome, selection);
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
        throw holdLost(pin.resourceId);
      case 'confirmed':
        return sameSelection(pin.reservation.outcome as unknown as CommitOutcome, selection);
      case 'pinned':
        return this.allocate(pool, pin.reservation, selection);
    }
  }

  private async allocate(pool: PoolEntity, r: StoredReservation, selection: string[]): Promise<CommitOutcome> {
    const chosen = new Set(selection);
    const picked = r.items.filter((i) => chosen.has(i.id)).sort((a, b) => compareIds(a.id, b.id));
    const outcome: CommitOutcome = {
      selection,
      allocated: picked.map((i) => ({ resourceId: i.id, value: i.v, version: i.n + 1 })),
      released: r.items.filter((i) => !chosen.has(i.id)).map((i) => i.id),
      owner: r.owner,
      items: r.items,
      expiresMs: r.expiresMs,
    };
    const result = await this.resources.allocate({
      poolId: pool.id,
      owner: r.owner,
      reservationId: r.id,
      items: picked.map((i) => ({ id: i.id, version: i.n })),
      body: outcome as unknown as Record<string, unknown>,
    });
    if (result === 'committed') {
      await this.finishQuietly(pool, r.id, picked, outcome);
      return outcome;
    }
    // Someone committed first: this reservation on another instance (a retry), or another owner.
    const row = await this.commits.find(r.id);
    if (row) {
      const committed = row.body as unknown as CommitOutcome;
      const committedIds = new Set(committed.selection);
      await this.finishQuietly(
        pool,
        r.id,
        r.items.filter((i) => committedIds.has(i.id)),
        committed,
      );
      return sameSelection(committed, selection);
    }
    this.metrics.confirmConflicts.inc({ reason: 'version_changed' });
    await this.abortWithTruth(pool, r);
    throw holdLost(picked.map((i) => i.id).join(','));
  }

  /** The commit is durable in Postgres; if Redis fails now, the sweeper finishes it from the commit row. */
  private async finishQuietly(pool: PoolEntity, reservationId: string, chosen: CachedItem[], outcome: CommitOutcome): Promise<void> {
    try {
      await this.holds.finish(pool.name, reservationId, chosen, outcome as unknown as Record<string, unknown>);
    } catch (err) {
      this.logger.warn(`commit of ${reservationId} is durable, Redis clean-up deferred to the sweeper: ${String(err)}`);
    }
  }

  /**
   * Ends a reservation whose commit did not (or could not) happen: its items go back to the free index
   * with the versions Postgres has now, except those Postgres shows allocated.
   */
  async abortWithTruth(pool: PoolEntity, r: StoredReservation): Promise<void> {
    const rows = await this.resources.findMany(
      pool.id,
      r.items.map((i) => i.id),
    );
    const byId = new Map(rows.map((row) => [row.id, row]));
    const allocated: string[] = [];
    const fresh: CachedItem[] = [];
    for (const item of r.items) {
      const row = byId.get(item.id);
      if (!row || row.state === RESOURCE_ALLOCATED) allocated.push(item.id);
      else if (row.version !== item.n) fresh.push(toCachedItem(row));
    }
    await this.holds.abort(pool.name, r.id, allocated, fresh);
  }

  /** Sweeper hand-off: a reservation stuck in its commit window. Finish it if Postgres has the commit, else abort it. */
  async recoverStalled(pool: PoolEntity, reservationId: string): Promise<'finished' | 'aborted' | 'gone'> {
    const r = await this.holds.read(pool.name, reservationId);
    if (!r || r.state !== 'confirming') return 'gone';
    const row = await this.commits.find(reservationId);
    if (row) {
      const committed = row.body as unknown as CommitOutcome;
      const ids = new Set(committed.selection);
      await this.holds.finish(
        pool.name,
        reservationId,
        r.items.filter((i) => ids.has(i.id)),
        committed as unknown as Record<string, unknown>,
      );
      return 'finished';
    }
    await this.abortWithTruth(pool, r);
    return 'aborted';
  }
}

function sameSelection(outcome: CommitOutcome, selection: string[]): CommitOutcome {
  if (outcome.selection.length === selection.length && outcome.selection.every((id, i) => id === selection[i])) return outcome;
  throw new DomainError(ErrorCode.RESERVATION_CLOSED, 'the reservation was already confirmed with a different selection', {
    confirmed: outcome.selection,
  });
}

function holdLost(resourceIds: string): DomainError {
  return new DomainError(ErrorCode.HOLD_LOST, 'an item of the reservation was taken by someone else; nothing was allocated', {
    resourceIds: resourceIds.split(','),
  });
}

export function notFound(reservationId: string): DomainError {
  return new DomainError(ErrorCode.RESERVATION_NOT_FOUND, 'no such reservation', { id: reservationId });
}
