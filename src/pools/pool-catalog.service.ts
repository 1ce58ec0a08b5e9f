import { Injectable } from '@nestjs/common';
import { DomainError, ErrorCode } from '../common/errors.js';
import { PoolEntity } from '../database/entities.js';
import { PoolRepository } from '../database/pool.repository.js';

/**
 * Pools never change once created, so each instance keeps the ones it has seen in memory: the
 * reserve path then needs no Postgres round trip.
 */
@Injectable()
export class PoolCatalog {
  private readonly byName = new Map<string, PoolEntity>();

  constructor(private readonly pools: PoolRepository) {}

  async get(name: string): Promise<PoolEntity> {
    const cached = this.byName.get(name);
    if (cached) return cached;
    const pool = await this.pools.findByName(name);
    if (!pool) throw new DomainError(ErrorCode.POOL_NOT_FOUND, `pool "${name}" does not exist`, { pool: name });
    this.byName.set(name, pool);
    return pool;
  }

  remember(pool: PoolEntity): void {
    this.byName.set(pool.name, pool);
  }

  /** Every pool, fresh from Postgres (the sweeper's and the rebuild's list). */
  async all(): Promise<PoolEntity[]> {
    const pools = await this.pools.findAll();
    for (const pool of pools) this.byName.set(pool.name, pool);
    return pools;
  }

  /** The pools this instance knows, without asking Postgres. */
  known(): PoolEntity[] {
    return [...this.byName.values()];
  }
}
