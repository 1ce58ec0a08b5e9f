import { Injectable, Logger } from '@nestjs/common';
import { randomUUID } from 'node:crypto';
import { AppConfig } from '../config/app-config.js';
import { CommitRepository, KeyedCommitRow } from '../database/commit.repository.js';
import { GenerationRepository } from '../database/generation.repository.js';
import { JobMutexRepository } from '../database/job-mutex.repository.js';
import { ResourceRepository } from '../database/resource.repository.js';
import { MetricsService } from '../metrics/metrics.service.js';
import { PoolCatalog } from '../pools/pool-catalog.service.js';
import { isStringRecord } from '../common/validators.js';
import { DomainError, ErrorCode } from '../common/errors.js';
import { HoldStore, REBUILDING, RedisCheckpoint, toCachedItem, unfinishedRound } from '../redis/hold-store.repository.js';
import { monotonicMs } from '../common/clock.js';

const JOB = 'rebuild';
const LEASE_MS = 30_000;
const PAGE = 5000;
/** Rounds a rebuild starts again, at most, after Redis lost a pool's keys during one (see rebuildOnce). */
const MAX_ROUNDS = 5;
/** A step of the checkpoint (see checkpoint) at most this often, however many instances take them. */
export const CHECKPOINT_STEP_MS = 900;
/** How long the check of a new connection to Redis waits for Postgres (see checkAfterConnect). */
const CONNECT_CHECK_MS = 1000;

/**
 * `unfinished`: the marker says a rebuild began, and none holds the job (it failed, or its instance died). `rolledBack`:
 * Redis went back in time (see checkpoint).
 */
export type RebuildReason = 'startup' | 'wiped' | 'unfinished' | 'periodic' | 'rolledBack';

/** The job changed hands while this instance held it (its lease ran out while the process was stalled). */
class LeaseLost extends Error {}

/**
 * Rebuilds the Redis free index from Postgres, the source of truth: every free row that is not under a
 * live hold goes back into the index. One instance at a time, elected by the t_job_mutex version CAS.
 */
@Injectable()
export class RebuildService {
  private readonly logger = new Logger(RebuildService.name);
  readonly instanceId = randomUUID();

  constructor(
    private readonly mutex: JobMutexRepository,
    private readonly generations: GenerationRepository,
    private readonly resources: ResourceRepository,
    private readonly catalog: PoolCatalog,
    private readonly holds: HoldStore,
    private readonly metrics: MetricsService,
    private readonly commits: CommitRepository,
    private readonly config: AppConfig,
  ) {
    holds.checkOnConnect(() => this.checkAfterConnect());
  }

  /**
   * Returns the number of items added to the index, or null when another instance holds the job, or took it
   * while this one stalled (it then stops where it noticed, and leaves the rest to that instance).
   */
  async rebuild(reason: RebuildReason): Promise<number | null> {
    // One at a time in this instance too: the lease it holds is one (the sweeper calls this from one loop; a
    // second caller, a test or a tool, would share the lease and renew it under the first).
    if (this.running) return null;
    this.running = true;
    try {
      return await this.rebuildOnce(reason);
    } finally {
      this.running = false;
    }
  }

  private running = false;

  private async rebuildOnce(reason: RebuildReason): Promise<number | null> {
    const lease = await this.mutex.acquire(JOB, this.instanceId, LEASE_MS);
    if (lease === null) return null;
    this.lease = lease;
    this.lastRenewal = monotonicMs();
    const started = monotonicMs();
    try {
      // Seen wiped before the job was ours: another instance may have rebuilt since. Bumping the
      // generation again would fence the holds taken on its rebuild.
      if (reason === 'wiped' && (await this.holds.markerPresent())) return 0;
      // Likewise, an unfinished rebuild another instance has finished since. One that is still unfinished is
      // done again in the current generation, as at start-up. When its last round began after a wipe (it bumped
      // the generation: `fresh`) and its round key is still there (no wipe since), the pools it had not given
      // the generation yet get it now: they hold nothing, and a bump would fence the holds taken since.
      let adopt = false;
      if (reason === 'unfinished') {
        const deadRound = unfinishedRound(await this.holds.marker());
        if (deadRound === null) return 0;
        adopt = deadRound.endsWith(':fresh') && (await this.holds.rebuildRoundKeyPresent(deadRound));
      }
      // No marker: Redis was wiped, or this version's key layout is new to it (the marker's name changed).
      if (reason === 'wiped') await this.holds.dropLegacyAttributeSets(() => this.renewLease());
      // Every rebuild (one runs at every start): an older version, started on this Redis again (a rollback), finds
      // no marker of its layout and rebuilds Redis in its own, rather than take this layout's keys for its own.
      // (Not a sign of a wipe: the upgrade from layout 2 to 3 left layout 2's.)
      await this.holds.dropLegacyMarkers();
      // Redis went back in time, unless another instance has rebuilt it since: what it holds is dropped, and it is
      // rebuilt as after a wipe.
      if (reason === 'rolledBack') {
        // The generation first: a rebuild by another instance after this one found Redis behind bumps it, and the drop
        // leaves the pools that rebuild gave a newer one alone, should this instance stall in between.
        const generation = await this.generations.current();
        const behind = await this.behind();
        if (behind === null) return 0;
        this.logger.error(
          `Redis went back in time: its checkpoint is ${behind.redis}, Postgres' ${behind.postgres} (Redis was restored ` +
            'from an older snapshot, or failed over to a replica that lagged); dropping its respool keys, holds included, ' +
            'and rebuilding them from Postgres as after a wipe',
        );
        const pools = (await this.catalog.all()).map((pool) => pool.name);
        const dropped = await this.holds.dropAll(behind.seen, behind.postgres, generation, pools, () => this.renewLease());
        this.logger.warn(`rebuild (rolledBack): ${dropped} Redis keys dropped`);
      }
      let added = 0;
      let keys = 0;
      let roundMarker = '';
      let lastRun = '';
      for (let round = 1; ; round++) {
        // After a wipe, a new Redis generation: commits pinned before it can no longer land (the bump waits
        // for those in flight), so the items the rebuild hands out again are really free.
        const fresh = reason === 'wiped' || reason === 'rolledBack' || round > 1;
        const generation = fresh ? await this.bumpGeneration() : await this.generations.current();
        // The marker tells the sweepers Redis holds rebuilt state. Whether Redis was wiped during this round, only
        // the round's own key tells: the marker's value may be another instance's (one that stalled past its
        // lease may still write it), and taking that for a wipe would bump the generation for nothing.
        const run = `${this.instanceId}:${started}:${round}:${fresh ? 'fresh' : 'current'}`;
        roundMarker = `${generation}${REBUILDING}${run}`;
        lastRun = run;
        await this.holds.startRebuildRound(run, roundMarker);
        const pools = await this.catalog.all();
        // Every pool gets the generation before any item is added, so no hold is taken in an older one. In
        // the current generation only over an existing key: a missing one means Redis was wiped after this
        // rebuild began, and holds taken on what it adds now would be fenced by the bump that must follow.
        let intact = true;
        const mode = fresh || (adopt && round === 1) ? 'always' : 'ifPresent';
        for (const pool of pools) {
          // Before the pool has a generation, a reserve there finds nothing and sets no key. Should Redis be wiped
          // after the keys are back and before the generation is, the generation is not written (nor the keys kept).
          if (mode === 'always') keys += await this.restoreIdempotencyKeys(pool.id, pool.name, run);
          intact = (await this.holds.setGeneration(pool.name, generation, mode, mode === 'always' ? run : '')) && intact;
        }
        if (!intact) {
          await this.holds.endRebuildRound(run);
          // Redis losing its keys round after round (wiped again and again, or evicting): the rebuild ends unfinished,
          // and the sweeper's next check starts it again, rather than bump the generation in a tight loop.
          if (round >= MAX_ROUNDS) {
            throw new Error(`Redis lost a pool's keys during each of ${MAX_ROUNDS} rebuild rounds; the rebuild stays unfinished`);
          }
          this.logger.warn('a pool has no Redis generation: Redis was wiped; rebuilding in a new generation');
          continue;
        }
        for (const pool of pools) {
          await this.holds.dropLegacyItemCache(pool.name);
          added += await this.rebuildPool(pool.id, pool.name, generation);
          await this.renewLease();
        }
        if ((await this.holds.endRebuildRound(run)) || round === 3) break;
        this.logger.warn('Redis was wiped during the rebuild; rebuilding again');
      }
      // Not over the marker of an instance that took the job meanwhile: it would take that for a wipe.
      await this.renewLease(true);
      // Nor into a Redis wiped after the last round began (a restart as this rebuild ended, or during a
      // third round): without a marker, the next check sees that wipe and rebuilds.
      // Never the same value twice (see HoldStore.setCheckpoint): the time and this rebuild's last round.
      if (!(await this.holds.markRebuilt(roundMarker, `rebuilt:${new Date().toISOString()} ${lastRun}`))) {
        this.logger.warn(
          `rebuild (${reason}): the marker changed after the last round began (Redis wiped, or another instance ` +
            'rebuilding); not marked rebuilt, so the next check rebuilds if Redis was wiped',
        );
      }
      this.metrics.rebuilds.inc({ reason });
      this.metrics.keysRestored.inc(keys);
      if (added > 0 || reason !== 'periodic') {
        const putBack = keys > 0 ? `, ${keys} Idempotency-Keys of confirmed reservations put back` : '';
        const line = `rebuild (${reason}): ${added} free items re-indexed${putBack} in ${Math.round(monotonicMs() - started)} ms`;
        // Redis lost data (every hold with it) or went back in time: a warning, unless there was nothing to lose (a
        // first start on an empty Redis).
        if ((reason === 'wiped' || reason === 'rolledBack') && added + keys > 0) this.logger.warn(line);
        else this.logger.log(line);
      }
      return added;
    } catch (err) {
      if (!(err instanceof LeaseLost)) throw err;
      this.logger.warn(
        `rebuild (${reason}) stopped after ${Math.round(monotonicMs() - started)} ms: its lease ran out while this instance stalled, ` +
          'and another instance took the job',
      );
      return null;
    } finally {
      await this.mutex.release(JOB, this.instanceId).catch(() => undefined);
    }
  }

  /**
   * Tells whether Redis went back in time (restored from an older snapshot, or failed over to a replica that lagged),
   * and moves the checkpoint on; the sweeper calls it about once a second on every instance. The checkpoint is a
   * number kept in Postgres and in Redis. An instance raises Postgres' from `p` only after it read Redis' at `p` or
   * more, then raises Redis' to match (unless Redis was rebuilt, or another instance wrote it, since it read it). So
   * Redis' is never more than one behind Postgres', though an instance may stall between the two writes: read in that
   * order, Redis' below Postgres' minus one means Redis lost writes. A step is taken at most every CHECKPOINT_STEP_MS,
   * however many instances try, so the loss is found once Redis' copy is two steps old: about two seconds. Returns true
   * then, and the caller rebuilds.
   */
  async checkpoint(): Promise<boolean> {
    const postgres = await this.generations.checkpoint();
    const seen = await this.holds.checkpoint();
    // Wiped: the rebuild sees to it. (While a rebuild runs, the checkpoint goes on: a Redis restored from a snapshot
    // taken then, or a rebuild that ends in a Redis that went back in time meanwhile, is found too.)
    if (!hasMarker(seen)) return false;
    if (seen.n === null) {
      // The first check since a rebuild (or of this version): Redis starts at Postgres' number, read after the key was
      // seen missing (a number read before might be one that Postgres has since moved past).
      await this.holds.setCheckpoint(seen, await this.generations.checkpoint());
      return false;
    }
    if (behindOf(postgres, seen) !== null) return true;
    if (seen.n === postgres - 1) {
      // An instance raised Postgres' and has not raised Redis' (yet: it may have stalled, or died): done for it.
      await this.holds.setCheckpoint(seen, postgres);
      return false;
    }
    // Redis has caught up (Redis ahead only if Postgres itself went back: it jumps past Redis).
    const next = seen.n + 1;
    if (await this.generations.advanceCheckpoint(postgres, next, CHECKPOINT_STEP_MS)) await this.holds.setCheckpoint(seen, next);
    return false;
  }

  /** Redis' checkpoint and Postgres', if Redis' is behind (read as checkpoint reads them); null if it is not. */
  private async behind(): Promise<Behind | null> {
    const postgres = await this.generations.checkpoint();
    return behindOf(postgres, await this.holds.checkpoint());
  }

  /**
   * Runs before the first reserve, read or release on each connection to Redis, and before a pin or an extend answers
   * (HoldStore.checkOnConnect):
   * a Redis restored from a snapshot, or a replica promoted, is met by a new connection, and its first reserve must not
   * hand out items, or make a new reservation for an Idempotency-Key it lost, nor a release, extend or confirm act on a
   * reservation as it was then, before the sweeper's next check finds it behind. Resolves true if it is not. While it
   * is, starts the rebuild that drops it, and answers 503. Should Postgres not answer within a second, resolves false:
   * they go on, as they do while Postgres is down, and the check is made again later.
   */
  private async checkAfterConnect(): Promise<boolean> {
    let timer: NodeJS.Timeout | undefined;
    const postgres = await Promise.race([
      this.generations.checkpoint().catch(() => null),
      new Promise<null>((resolve) => (timer = setTimeout(() => resolve(null), CONNECT_CHECK_MS))),
    ]);
    clearTimeout(timer);
    if (postgres === null) return false;
    const behind = behindOf(postgres, await this.holds.checkpoint());
    if (behind === null) return true;
    void this.rebuild('rolledBack').catch((err: unknown) => this.logger.warn(`rebuild (rolledBack) failed: ${String(err)}`));
    throw new DomainError(
      ErrorCode.DEPENDENCY_UNAVAILABLE,
      'redis went back in time (restored from an older snapshot, or failed over to a replica that lagged) and is being rebuilt from postgres; nothing was changed',
      { dependency: 'redis' },
    );
  }

  /** The version of the job's row this instance holds it at. */
  private lease = '';
  private lastRenewal = 0;

  /**
   * Renews the job's lease if a few seconds passed since the last renewal (long walks call it often), or
   * `now`. Throws LeaseLost if the job changed hands since this instance took it.
   */
  private async renewLease(now = false): Promise<void> {
    if (!now && monotonicMs() - this.lastRenewal < LEASE_MS / 6) return;
    this.lastRenewal = monotonicMs();
    this.keep(await this.mutex.renew(JOB, this.instanceId, this.lease));
  }

  /** Holds the job at the version a renewal gave, or throws LeaseLost if there was none. */
  private keep(renewed: string | null): void {
    if (renewed === null) throw new LeaseLost();
    this.lease = renewed;
    this.lastRenewal = monotonicMs();
  }

  /**
   * Bumps the Redis generation in the transaction that renews the lease: an instance that stalled past its
   * lease cannot bump it (that would fence every hold taken since, so their confirms would fail).
   */
  private async bumpGeneration(): Promise<number> {
    let renewed = null as string | null;
    const generation = await this.generations.bump(async (tx) => {
      renewed = await this.mutex.renew(JOB, this.instanceId, this.lease, tx);
      return renewed !== null;
    });
    this.keep(generation === null ? null : renewed);
    return generation!;
  }

  /**
   * Puts back the pool's Idempotency-Keys of its confirmed reservations made within the last IDEMPOTENCY_TTL_MS, each
   * for what is left of its lifetime, from their commits in Postgres: a keyed reserve retried after a wipe answers with
   * its confirmed reservation (200) rather than make a new one. The keys of reservations that were only held are not
   * kept anywhere but Redis: their holds are gone with the wipe, and a retry makes a new reservation. Returns how many
   * were put back.
   */
  private async restoreIdempotencyKeys(poolId: string, pool: string, round: string): Promise<number> {
    await this.holds.beginKeyRestore(pool, round);
    let restored = 0;
    let after: KeyedCommitRow | undefined;
    for (;;) {
      const rows = await this.commits.keyedSince(poolId, this.config.IDEMPOTENCY_TTL_MS, PAGE, after);
      if (rows.length === 0) return restored;
      restored += await this.holds.restoreIdempotencyKeys(pool, rows);
      after = rows[rows.length - 1];
      await this.renewLease();
    }
  }

  /** Rows the scripts cannot index (written outside the API before Postgres refused them) stay out of Redis. */
  private reportUnindexable(pool: string, rows: readonly { id: string }[]): void {
    const ids = rows
      .slice(0, 10)
      .map((row) => row.id)
      .join(', ');
    this.logger.warn(
      `pool "${pool}": ${rows.length} free row(s) left out of Redis because their attributes are not a flat object ` +
        `of strings (ids ${ids}${rows.length > 10 ? ', ...' : ''}); fix them in t_resource and the next rebuild adds them`,
    );
  }

  private async rebuildPool(poolId: string, pool: string, generation: number): Promise<number> {
    let added = 0;
    let after = '0';
    for (;;) {
      const readAt = await this.holds.clock();
      const rows = await this.resources.freePage(poolId, after, PAGE);
      if (rows.length === 0) return added;
      const indexable: typeof rows = [];
      const unindexable: typeof rows = [];
      // Postgres refuses other attributes since migration AttributesAreStrings; rows from before it may remain.
      for (const row of rows) (isStringRecord(row.attributes) ? indexable : unindexable).push(row);
      if (unindexable.length > 0) this.reportUnindexable(pool, unindexable);
      // An item allocated after the read is kept out by its tombstone only for so long: a page that reached Redis
      // later than that (this instance stalled) adds nothing, and is read again.
      const page = await this.holds.addFree(pool, generation, readAt, indexable.map(toCachedItem));
      if (page === null) {
        this.logger.warn(`pool "${pool}": a rebuild page reached Redis too long after it was read; reading it again`);
        await this.renewLease();
        continue;
      }
      added += page;
      after = rows[rows.length - 1].id;
      await this.renewLease(); // a pool of millions of items takes longer than one lease
    }
  }
}

interface Behind {
  redis: number;
  postgres: number;
  /** The marker and Redis' checkpoint as read. */
  seen: RedisCheckpoint & { marker: string };
}

/** Redis' checkpoint and Postgres' if Redis' (`seen`, read after `postgres`) is behind; null if it is not. */
function behindOf(postgres: number, seen: RedisCheckpoint): Behind | null {
  return hasMarker(seen) && seen.n !== null && seen.n < postgres - 1 ? { redis: seen.n, postgres, seen } : null;
}

/** Redis has a rebuilt-marker (rebuilt, or being rebuilt): it was not wiped. */
function hasMarker(seen: RedisCheckpoint): seen is RedisCheckpoint & { marker: string } {
  return seen.marker !== null;
}
