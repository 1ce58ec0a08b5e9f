import { Injectable } from '@nestjs/common';
import { Counter, Gauge, Histogram, Registry, collectDefaultMetrics } from 'prom-client';
import { PoolRepository } from '../database/pool.repository.js';
import { HoldStore } from '../redis/hold-store.repository.js';
import { monotonicMs } from '../common/clock.js';

/** How old the pool counts of a scrape may be. */
const POOL_ITEMS_MAX_AGE_MS = 5000;
/**
 * How long a scrape waits for the pool counts at most: while Postgres hangs, it waited DB_TIMEOUT_MS (5 s) every time,
 * and a scrape timeout at or below that lost every series just when they matter. The read goes on; a scrape that
 * comes after it ended (within POOL_ITEMS_MAX_AGE_MS) gets its counts.
 */
export const POOL_ITEMS_WAIT_MS = 1000;

/** The counts, or a failure once POOL_ITEMS_WAIT_MS has passed without them (a scrape that finds the read under way waits afresh). */
function waitedFor<T>(counts: Promise<T>): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<never>((_resolve, reject) => {
    timer = setTimeout(() => reject(new Error(`the pool counts took longer than ${POOL_ITEMS_WAIT_MS} ms`)), POOL_ITEMS_WAIT_MS);
    timer.unref();
  });
  return Promise.race([counts, late]).finally(() => clearTimeout(timer));
}

interface PoolItems {
  name: string;
  free: number;
  held: number;
  allocated: number;
}

/** Prometheus metrics of one app instance (its own registry, so several instances may share a process in tests). */
@Injectable()
export class MetricsService {
  readonly registry = new Registry();

  readonly httpDuration = new Histogram({
    name: 'respool_http_request_duration_seconds',
    help: 'HTTP request latency by route',
    labelNames: ['method', 'route', 'status'] as const,
    buckets: [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5],
    registers: [this.registry],
  });

  readonly reservations = new Counter({
    name: 'respool_reservations_total',
    help: 'Reserve and pull-next attempts by outcome (ok, replay, leased, exhausted, quota, reused)',
    labelNames: ['pool', 'outcome'] as const,
    registers: [this.registry],
  });

  readonly expiredHolds = new Counter({
    name: 'respool_expired_holds_total',
    help: 'Reservations and leases whose hold expired and whose items the sweeper returned',
    labelNames: ['pool'] as const,
    registers: [this.registry],
  });

  readonly confirmConflicts = new Counter({
    name: 'respool_confirm_conflicts_total',
    help: 'Confirms and completions refused because an item was taken (hold_taken), its version changed (version_changed), both 409, or the commit outlasted COMMIT_WINDOW_MS twice (commit_window_passed, 503)',
    labelNames: ['reason'] as const,
    registers: [this.registry],
  });

  readonly waitingReserves = new Gauge({
    name: 'respool_waiting_reserves',
    help: 'Reserves waiting for free items (waitMs) on this instance now; at MAX_WAITING_RESERVES one more is refused 429',
    registers: [this.registry],
  });

  readonly waitingFirstInLine = new Gauge({
    name: 'respool_waiting_reserves_first_in_line',
    help:
      'Waiting reserves on this instance that are first in their waiting line and, not woken when items come free (the ' +
      'subscription down), try again at most every 75 ms (at most 64)',
    registers: [this.registry],
  });

  readonly waitersWoken = new Counter({
    name: 'respool_waiting_reserves_woken_total',
    help: 'Waiting reserves on this instance woken to try again at once because items came free in their pool',
    registers: [this.registry],
  });

  readonly rebuilds = new Counter({
    name: 'respool_rebuilds_total',
    help: 'Rebuilds of the Redis free index from Postgres run by this instance, by reason',
    labelNames: ['reason'] as const,
    registers: [this.registry],
  });

  readonly keysRestored = new Counter({
    name: 'respool_idempotency_keys_restored_total',
    help: "Idempotency-Keys of confirmed reservations this instance's rebuilds put back into Redis from Postgres after a loss of Redis data",
    registers: [this.registry],
  });

  constructor(
    private readonly pools: PoolRepository,
    private readonly holds: HoldStore,
  ) {
    collectDefaultMetrics({ register: this.registry, prefix: 'respool_' });
    const read = () => this.readPoolItems();
    new Gauge({
      name: 'respool_pool_items',
      help: `Items per pool by state (free, held, allocated), read at scrape time (at most every ${POOL_ITEMS_MAX_AGE_MS / 1000} s)`,
      labelNames: ['pool', 'state'] as const,
      registers: [this.registry],
      // A failed read keeps the last values (respool_pool_items_stale says so) rather than failing the whole
      // scrape: the other series matter most while a dependency is down.
      async collect() {
        try {
          const counts = await read();
          this.reset();
          for (const p of counts) {
            this.set({ pool: p.name, state: 'free' }, p.free);
            this.set({ pool: p.name, state: 'held' }, p.held);
            this.set({ pool: p.name, state: 'allocated' }, p.allocated);
          }
        } catch {
          // The last values stay; respool_pool_items_stale says so.
        }
      },
    });
    new Gauge({
      name: 'respool_pool_items_stale',
      help: '1 when this scrape could not read the pool counts (Postgres or Redis down): respool_pool_items are older',
      registers: [this.registry],
      // The same read as respool_pool_items (shared, see readPoolItems): whether it failed.
      async collect() {
        this.set(
          await read().then(
            () => 0,
            () => 1,
          ),
        );
      },
    });
  }

  private poolItems: { at: number; counts: Promise<PoolItems[]> } | undefined;

  /**
   * The pool counts, read at most every POOL_ITEMS_MAX_AGE_MS and once for scrapes that come together:
   * counting a pool of millions of rows takes a second, and a scrape is not worth more.
   */
  private readPoolItems(): Promise<PoolItems[]> {
    const now = monotonicMs();
    if (this.poolItems && now - this.poolItems.at < POOL_ITEMS_MAX_AGE_MS) return waitedFor(this.poolItems.counts);
    const counts = (async () => {
      const items: PoolItems[] = [];
      for (const p of await this.pools.allCounts()) {
        const free = Math.min(await this.holds.freeCount(p.name), p.total - p.allocated);
        items.push({ name: p.name, free, held: p.total - p.allocated - free, allocated: p.allocated });
      }
      return items;
    })();
    // A failure is not kept: the next scrape reads again.
    counts.catch(() => {
      if (this.poolItems?.counts === counts) this.poolItems = undefined;
    });
    this.poolItems = { at: now, counts };
    return waitedFor(counts);
  }

  async render(): Promise<{ contentType: string; body: string }> {
    return { contentType: this.registry.contentType, body: await this.registry.metrics() };
  }
}
