import { Injectable } from '@nestjs/common';
import { DataSource } from 'typeorm';
import { PoolEntity } from './entities.js';
import { pg } from './postgres.js';
import { sqlStateOf } from '../common/dependency-errors.js';

export interface NewPool {
  name: string;
  kind: 'number' | 'task';
  holdTtlMs: number;
  maxHoldTtlMs: number;
  maxHoldsPerOwner: number | null;
}

export interface PoolCounts {
  total: number;
  allocated: number;
}

@Injectable()
export class PoolRepository {
  constructor(private readonly db: DataSource) {}

  /** Inserts a pool; null when the name is taken. */
  async insert(pool: NewPool): Promise<PoolEntity | null> {
    return pg(async () => {
      try {
        const repo = this.db.getRepository(PoolEntity);
        return await repo.save(repo.create(pool));
      } catch (err) {
        if (sqlStateOf(err) === '23505') return null;
        throw err;
      }
    });
  }

  findByName(name: string): Promise<PoolEntity | null> {
    return pg(() => this.db.getRepository(PoolEntity).findOneBy({ name }));
  }

  /** Which of these pools were created more than `ageMs` ago, judged by Postgres' clock alone (created_at is its now()). */
  async createdBefore(names: string[], ageMs: number): Promise<string[]> {
    const rows: { name: string }[] = await pg(() =>
      this.db.query(`SELECT name FROM t_pool WHERE name = ANY($1) AND created_at < now() - $2 * interval '1 millisecond'`, [names, ageMs]),
    );
    return rows.map((row) => row.name);
  }

  findAll(): Promise<PoolEntity[]> {
    return pg(() => this.db.getRepository(PoolEntity).find({ order: { id: 'ASC' } }));
  }

  async counts(poolId: string): Promise<PoolCounts> {
    const rows: { total: string; allocated: string }[] = await pg(() =>
      this.db.query(
        `SELECT count(*) AS total, count(*) FILTER (WHERE state = 2) AS allocated
           FROM t_resource WHERE pool_id = $1`,
        [poolId],
      ),
    );
    return { total: Number(rows[0].total), allocated: Number(rows[0].allocated) };
  }

  /** Per-pool counts of every pool at once, for the metrics scrape. */
  async allCounts(): Promise<{ name: string; total: number; allocated: number }[]> {
    const rows: { name: string; total: string; allocated: string }[] = await pg(() =>
      this.db.query(
        `SELECT p.name, count(r.id) AS total, count(r.id) FILTER (WHERE r.state = 2) AS allocated
           FROM t_pool p LEFT JOIN t_resource r ON r.pool_id = p.id
          GROUP BY p.id, p.name`,
      ),
    );
    return rows.map((r) => ({ name: r.name, total: Number(r.total), allocated: Number(r.allocated) }));
  }
}
