import { Injectable, Logger, OnApplicationBootstrap, OnModuleDestroy } from '@nestjs/common';
import { AppConfig } from '../config/app-config.js';
import { DomainError, ErrorCode } from '../common/errors.js';
import { MetricsService } from '../metrics/metrics.service.js';
import { PoolEntity } from '../database/entities.js';
import { PoolCatalog } from '../pools/pool-catalog.service.js';
import { HoldStore } from '../redis/hold-store.repository.js';
import { CommitService } from '../reservations/commit.service.js';
import { RebuildService } from './rebuild.service.js';
import { MAX_BATCHES_PER_TICK, SWEEP_BATCH, SWEEP_WORK_BUDGET } from './sweep-limits.js';

const POOL_LIST_REFRESH_MS = 2000;
const WIPE_CHECK_MIN_GAP_MS = 500;

/**
 * Runs on every instance: returns expired holds to the pool (one Lua script per pool per tick), hands
 * commits stuck past their window to the commit service, and triggers the rebuild when Redis was wiped
 * and periodically.
 */
@Injectable()
export class SweeperService implements OnApplicationBootstrap, OnModuleDestroy {
  private readonly logger = new Logger(SweeperService.name);
  private timer: NodeJS.Timeout | undefined;
  private stopped = false;
  private running: Promise<void> | undefined;
  private lastPoolRefresh = 0;
  private lastRebuild = 0;
  private lastWipeCheck = 0;
  private readonly warned = new Set<string>();
  private tickFailed = false;

  constructor(
    private readonly config: AppConfig,
    private readonly holds: HoldStore,
    private readonly catalog: PoolCatalog,
    private readonly rebuilder: RebuildService,
    private readonly committer: CommitService,
    private readonly metrics: MetricsService,
  ) {}

  async onApplicationBootstrap(): Promise<void> {
    // Start-up: bring Redis in line with Postgres before serving (another instance may be doing it).
    await this.rebuildIfNeeded(true).catch((err: unknown) => this.warn('start-up rebuild', err));
    this.schedule();
  }

  /** Stops before the HTTP server and the connections close (Nest runs onModuleDestroy first). */
  async onModuleDestroy(): Promise<void> {
    this.stopped = true;
    if (this.timer) clearTimeout(this.timer);
    await this.running;
  }

  private schedule(): void {
    if (this.stopped) return;
    this.timer = setTimeout(() => {
      this.running = this.tick().finally(() => {
        this.running = undefined;
        this.schedule();
      });
    }, this.config.SWEEP_INTERVAL_MS);
    this.timer.unref();
  }

  /**
   * One pass: every known pool's expired holds first (Redis only, so expiry goes on while Postgres is
   * down), then the stalled commits, the pool list and the wiped-Redis check, each failing on its own.
   */
  async tick(): Promise<void> {
    this.tickFailed = false;
    const stalled: { pool: PoolEntity; rid: string }[] = [];
    for (const pool of this.catalog.known()) {
      try {
        // Batches until the pool has nothing due (bounded), so expiry keeps up with any reserve rate.
        for (let batch = 0; batch < MAX_BATCHES_PER_TICK; batch++) {
          const swept = await this.holds.sweep(pool.name, SWEEP_BATCH, this.config.COMMIT_WINDOW_MS, SWEEP_WORK_BUDGET);
          if (swept.expiredReservations > 0) {
            this.metrics.expiredHolds.inc({ pool: pool.name }, swept.expiredReservations);
            this.logger.debug(`${pool.name}: ${swept.expiredReservations} expired holds, ${swept.freedItems} items freed`);
          }
          for (const rid of swept.stalled) stalled.push({ pool, rid });
          if (!swept.more) break;
        }
      } catch (err) {
        this.warn(`sweep of ${pool.name}`, err);
      }
    }
    for (const { pool, rid } of stalled) {
      try {
        const outcome = await this.committer.recoverStalled(pool, rid);
        this.logger.log(`${pool.name}: commit of ${rid} settled after its window: ${outcome}`);
      } catch (err) {
        this.warn(`settling the commit of ${rid}`, err);
      }
    }
    try {
      const now = Date.now();
      if (now - this.lastPoolRefresh > POOL_LIST_REFRESH_MS) {
        await this.catalog.all();
        this.lastPoolRefresh = now;
      }
      await this.rebuildIfNeeded(false);
    } catch (err) {
      this.warn('rebuild check', err);
    }
    if (!this.tickFailed) this.warned.clear();
  }

  private async rebuildIfNeeded(startup: boolean): Promise<void> {
    const now = Date.now();
    const periodic = this.config.RECONCILE_INTERVAL_MS > 0 && now - this.lastRebuild > this.config.RECONCILE_INTERVAL_MS;
    if (!startup && !periodic && now - this.lastWipeCheck < WIPE_CHECK_MIN_GAP_MS) return;
    this.lastWipeCheck = now;
    const wiped = !(await this.holds.markerPresent());
    if (!startup && !wiped && !periodic) return;
    const reason = wiped ? 'wiped' : startup ? 'startup' : 'periodic';
    const added = await this.rebuilder.rebuild(reason);
    // Another instance holding the job counts as done for the periodic run, not for a wipe.
    if (added !== null || !wiped) this.lastRebuild = now;
  }

  /** Logs a failure once, not on every tick while a dependency stays down. */
  private warn(what: string, err: unknown): void {
    const message =
      err instanceof DomainError && err.code === ErrorCode.DEPENDENCY_UNAVAILABLE ? err.message : String((err as Error)?.stack ?? err);
    const key = `${what}: ${message}`;
    this.tickFailed = true;
    if (!this.warned.has(key)) this.logger.warn(`${what} failed: ${message}`);
    this.warned.add(key);
    if (this.warned.size > 100) this.warned.clear();
  }
}
