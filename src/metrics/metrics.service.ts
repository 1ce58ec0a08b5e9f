import { Injectable } from '@nestjs/common';
import { Counter, Gauge, Histogram, Registry, collectDefaultMetrics } from 'prom-client';
import { PoolRepository } from '../database/pool.repository.js';
import { HoldStore } from '../redis/hold-store.repository.js';

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
    help: 'Confirms and completions refused because an item was taken (hold_taken) or its version changed (version_changed)',
    labelNames: ['reason'] as const,
    registers: [this.registry],
  });

  readonly rebuilds = new Counter({
    name: 'respool_rebuilds_total',
    help: 'Rebuilds of the Redis free index from Postgres run by this instance, by reason',
    labelNames: ['reason'] as const,
    registers: [this.registry],
  });

  constructor(
    private readonly pools: PoolRepository,
    private readonly holds: HoldStore,
  ) {
    collectDefaultMetrics({ register: this.registry, prefix: 'respool_' });
    const { pools: poolRepo, holds: holdStore } = this;
    new Gauge({
      name: 'respool_pool_items',
      help: 'Items per pool by state (free, held, allocated), read at scrape time',
      labelNames: ['pool', 'state'] as const,
      registers: [this.registry],
      async collect() {
        this.reset();
        for (const p of await poolRepo.allCounts()) {
          const free = Math.min(await holdStore.freeCount(p.name), p.total - p.allocated);
          this.set({ pool: p.name, state: 'free' }, free);
          this.set({ pool: p.name, state: 'held' }, p.total - p.allocated - free);
          this.set({ pool: p.name, state: 'allocated' }, p.allocated);
        }
      },
    });
  }

  async render(): Promise<{ contentType: string; body: string }> {
    return { contentType: this.registry.contentType, body: await this.registry.metrics() };
  }
}
