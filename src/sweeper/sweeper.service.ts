import { Injectable, Logger, OnApplicationBootstrap, OnModuleDestroy } from '@nestjs/common';
import { AppConfig } from '../config/app-config.js';
import { DomainError, ErrorCode } from '../common/errors.js';
import { MetricsService } from '../metrics/metrics.service.js';
import { PoolEntity } from '../database/entities.js';
import { PoolCatalog } from '../pools/pool-catalog.service.js';
import { PoolsService } from '../pools/pools.service.js';
import { HoldStore } from '../redis/hold-store.repository.js';
import { CommitService } from '../reservations/commit.service.js';
import { RebuildService } from './rebuild.service.js';
import { MAX_BATCHES_PER_TICK, SWEEP_BATCH, SWEEP_CONCURRENCY, SWEEP_WORK_BUDGET } from './sweep-limits.js';
import { monotonicMs } from '../common/clock.js';

type Loop = 'sweep' | 'upkeep' | 'rebuild';

const POOL_LIST_REFRESH_MS = 2000;
const WIPE_CHECK_MIN_GAP_MS = 500;
/** Between two checks of the Redis checkpoint (RebuildService.checkpoint) on one instance. */
const CHECKPOINT_GAP_MS = 1000;

/** Stalled commits waiting for the upkeep loop at most; the sweep reports a stalled one again a window later. */
const MAX_STALLED_QUEUED = 10_000;

/**
 * Runs on every instance, in three loops that never wait for each other: the sweep returns expired holds
 * to the pool (one Lua script per pool per batch; Redis only, so expiry keeps its 2 s promise while
 * Postgres is down or hangs); the upkeep hands commits stuck past their window to the commit service and
 * refreshes the pool list; and the rebuild loop rebuilds Redis when it was wiped or went back in time, and
 * periodically. A rebuild of large pools takes seconds (about 11 s for 1,000,000 free items): in the upkeep's
 * loop it held up the items of the commits that loop settles past the 2 s of invariant 4 (found by a review).
 */
@Injectable()
export class SweeperService implements OnApplicationBootstrap, OnModuleDestroy {
  private readonly logger = new Logger(SweeperService.name);
  private readonly timers = new Map<Loop, NodeJS.Timeout>();
  private readonly running = new Set<Promise<void>>();
  private stopped = false;
  private lastPoolRefresh = 0;
  private lastRebuild = 0;
  private lastWipeCheck = 0;
  private lastCheckpoint = 0;
  /** The upkeep found a pool without a Redis generation: the next rebuild check runs a rebuild (see finalizeLater). */
  private rebuildRequested = false;
  /** Reservations whose commit window ran out, found by the sweep, for the upkeep to settle; by pool and id. */
  private readonly stalled = new Map<string, { pool: PoolEntity; rid: string }>();
  private readonly warned = new Set<string>();
  private readonly failed: Record<Loop, boolean> = { sweep: false, upkeep: false, rebuild: false };

  constructor(
    private readonly config: AppConfig,
    private readonly holds: HoldStore,
    private readonly catalog: PoolCatalog,
    private readonly rebuilder: RebuildService,
    private readonly committer: CommitService,
    private readonly metrics: MetricsService,
    private readonly pools: PoolsService,
  ) {}

  async onApplicationBootstrap(): Promise<void> {
    // Start-up: bring Redis in line with Postgres before serving (another instance may be doing it).
    await this.rebuildIfNeeded(true).catch((err: unknown) => this.warn('rebuild', 'start-up rebuild', err));
    this.schedule('sweep');
    this.schedule('upkeep');
    this.schedule('rebuild');
  }

  /** Stops before the HTTP server and the connections close (Nest runs onModuleDestroy first). */
  async onModuleDestroy(): Promise<void> {
    this.stopped = true;
    for (const timer of this.timers.values()) clearTimeout(timer);
    await Promise.all(this.running);
  }

  private schedule(loop: Loop): void {
    if (this.stopped) return;
    const timer = setTimeout(() => {
      const run: Promise<void> = (loop === 'sweep' ? this.sweep() : loop === 'upkeep' ? this.upkeep() : this.rebuildCheck()).finally(() => {
        this.running.delete(run);
        this.schedule(loop);
      });
      this.running.add(run);
    }, this.config.SWEEP_INTERVAL_MS);
    timer.unref();
    this.timers.set(loop, timer);
  }

  /** The three loops once, the sweep first. */
  async tick(): Promise<void> {
    await this.sweep();
    await this.upkeep();
    await this.rebuildCheck();
  }

  /**
   * Every known pool's expired holds, in batches until a pool has nothing due (bounded), each pool on its own,
   * SWEEP_CONCURRENCY pools at a time, starting at a pool picked at random (so that no pool always comes last on
   * every instance).
   */
  async sweep(): Promise<void> {
    this.failed.sweep = false;
    const known = this.catalog.known();
    const start = Math.floor(Math.random() * known.length);
    const order = [...known.slice(start), ...known.slice(0, start)];
    let next = 0;
    const worker = async () => {
      while (next < order.length) await this.sweepPool(order[next++]);
    };
    await Promise.all(Array.from({ length: Math.min(SWEEP_CONCURRENCY, order.length) }, worker));
    this.forgetWarnings();
  }

  private async sweepPool(pool: PoolEntity): Promise<void> {
    try {
      for (let batch = 0; batch < MAX_BATCHES_PER_TICK; batch++) {
        const swept = await this.holds.sweep(pool.name, SWEEP_BATCH, this.config.COMMIT_WINDOW_MS, SWEEP_WORK_BUDGET);
        if (swept.expiredReservations > 0) {
          this.metrics.expiredHolds.inc({ pool: pool.name }, swept.expiredReservations);
          this.logger.debug(`${pool.name}: ${swept.expiredReservations} expired holds, ${swept.freedItems} items freed`);
        }
        for (const rid of swept.stalled) {
          if (this.stalled.size < MAX_STALLED_QUEUED) this.stalled.set(`${pool.name}\n${rid}`, { pool, rid });
        }
        if (!swept.more) break;
      }
    } catch (err) {
      this.warn('sweep', `sweep of ${pool.name}`, err);
    }
  }

  /**
   * The reserves and pins that got no answer and could not be undone yet, the landed commits whose Redis step failed,
   * the stalled commits the sweep found, the generation keys of new pools not finalized yet, the free items an import
   * or release left out of Redis, and the pool list, each failing on its own.
   */
  async upkeep(): Promise<void> {
    this.failed.upkeep = false;
    try {
      const undone = await this.holds.retryUndos();
      if (undone > 0) this.logger.log(`${undone} reserves and confirms that got no answer from Redis undone`);
    } catch (err) {
      this.warn('upkeep', 'undoing reserves that got no answer', err);
    }
    try {
      const finished = await this.committer.retryFinishes();
      if (finished > 0) this.logger.log(`${finished} landed commits finished in Redis after their first try failed`);
    } catch (err) {
      this.warn('upkeep', 'finishing landed commits in Redis', err);
    }
    for (const [key, entry] of [...this.stalled]) {
      // (Deleted first: should the sweep report it again meanwhile, that report stays for the next upkeep.)
      this.stalled.delete(key);
      try {
        const outcome = await this.committer.recoverStalled(entry.pool, entry.rid);
        this.logger.log(`${entry.pool.name}: commit of ${entry.rid} settled after its window: ${outcome}`);
      } catch (err) {
        this.warn('upkeep', `settling the commit of ${entry.rid}`, err);
        // Postgres or Redis is out: tried again at the next upkeep, last in line, with those not tried yet, not a
        // whole COMMIT_WINDOW_MS later when the sweep would report it again (its items stay pinned until then).
        if (err instanceof DomainError && err.code === ErrorCode.DEPENDENCY_UNAVAILABLE) {
          this.stalled.set(key, entry);
          break;
        }
      }
    }
    try {
      const { finalized, missing } = await this.pools.finalizeLater();
      if (finalized > 0) this.logger.log(`${finalized} new pools got their Redis generation after their creation could not write it`);
      if (missing > 0) {
        this.logger.warn(`${missing} pools have no Redis generation: a rebuild runs, as after a wipe`);
        this.rebuildRequested = true;
      }
    } catch (err) {
      this.warn('upkeep', 'writing the Redis generation of new pools', err);
    }
    try {
      const added = await this.pools.reindexPending();
      if (added > 0) this.logger.log(`${added} free items indexed in Redis after their import or release could not`);
    } catch (err) {
      this.warn('upkeep', 'indexing free items left out of Redis', err);
    }
    try {
      const now = monotonicMs();
      if (now - this.lastPoolRefresh > POOL_LIST_REFRESH_MS) {
        await this.catalog.all();
        this.lastPoolRefresh = now;
      }
    } catch (err) {
      this.warn('upkeep', 'refreshing the pool list', err);
    }
    this.forgetWarnings();
  }

  /** The wiped-Redis check, the checkpoint's (about once a second), and the rebuild they or the period call for. */
  async rebuildCheck(): Promise<void> {
    this.failed.rebuild = false;
    try {
      await this.rebuildIfNeeded(false);
    } catch (err) {
      this.warn('rebuild', 'rebuild check', err);
    }
    this.forgetWarnings();
  }

  private async rebuildIfNeeded(startup: boolean): Promise<void> {
    const now = monotonicMs();
    // (Or asked for by the upkeep, which found a pool without a generation: a periodic run takes that for a wipe.)
    const periodic =
      this.rebuildRequested || (this.config.RECONCILE_INTERVAL_MS > 0 && now - this.lastRebuild > this.config.RECONCILE_INTERVAL_MS);
    this.rebuildRequested = false;
    if (!startup && !periodic && now - this.lastWipeCheck < WIPE_CHECK_MIN_GAP_MS) return;
    this.lastWipeCheck = now;
    const state = await this.holds.rebuildState();
    const wiped = state === 'missing';
    // A rebuild that failed midway (a Postgres error on one page), or whose instance died, left part of the free
    // index out: done again at once, whatever RECONCILE_INTERVAL_MS says. While another instance runs one, it
    // holds the job and this does nothing.
    const unfinished = state === 'unfinished';
    // Redis restored from an older snapshot, or failed over to a replica that lagged, keeps a marker: the checkpoint
    // tells.
    let rolledBack = false;
    if (state !== 'missing' && (startup || now - this.lastCheckpoint >= CHECKPOINT_GAP_MS)) {
      this.lastCheckpoint = now;
      rolledBack = await this.rebuilder.checkpoint();
    }
    if (!startup && !wiped && !unfinished && !periodic && !rolledBack) return;
    const reason = rolledBack ? 'rolledBack' : wiped ? 'wiped' : unfinished ? 'unfinished' : startup ? 'startup' : 'periodic';
    const added = await this.rebuilder.rebuild(reason);
    // Another instance holding the job counts as done for the periodic run, not for a wipe or a rollback.
    if (added !== null || (!wiped && !rolledBack)) this.lastRebuild = now;
  }

  /** Once every loop ran without a failure: a failure that comes back is logged again. */
  private forgetWarnings(): void {
    if (!this.failed.sweep && !this.failed.upkeep && !this.failed.rebuild) this.warned.clear();
  }

  /** Logs a failure once, not on every run while a dependency stays down. */
  private warn(loop: Loop, what: string, err: unknown): void {
    const message =
      err instanceof DomainError && err.code === ErrorCode.DEPENDENCY_UNAVAILABLE ? err.message : String((err as Error)?.stack ?? err);
    const key = `${what}: ${message}`;
    this.failed[loop] = true;
    if (!this.warned.has(key)) this.logger.warn(`${what} failed: ${message}`);
    this.warned.add(key);
    if (this.warned.size > 100) this.warned.clear();
  }
}
