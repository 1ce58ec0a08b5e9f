import { Injectable } from '@nestjs/common';
import { DataSource, EntityManager } from 'typeorm';
import { pg } from './postgres.js';

/** pg_advisory lock key of the Redis generation: commits take it shared, the bump exclusive. */
export const GENERATION_LOCK = 7_361_905_022;

/**
 * The Redis generation (t_redis_generation). A rebuild after Redis was wiped bumps it; a commit only
 * lands in the generation its holds were taken in.
 */
@Injectable()
export class GenerationRepository {
  constructor(private readonly db: DataSource) {}

  async current(): Promise<number> {
    const rows: { gen: string }[] = await pg(() => this.db.query(`SELECT gen::text AS gen FROM t_redis_generation`));
    return Number(rows[0].gen);
  }

  /**
   * Waits for every commit in flight (they hold the lock shared), then moves to a new generation. `fence` runs
   * in the same transaction first (the rebuild renews its job lease there): if it answers false, nothing
   * changes and the bump answers null.
   */
  async bump(fence: (tx: EntityManager) => Promise<boolean> = async () => true): Promise<number | null> {
    return pg(() =>
      this.db.transaction(async (tx) => {
        await tx.query(`SELECT pg_advisory_xact_lock($1)`, [GENERATION_LOCK]);
        if (!(await fence(tx))) return null;
        const rows: { gen: string }[] = await tx.query(
          `WITH bumped AS (UPDATE t_redis_generation SET gen = gen + 1 RETURNING gen) SELECT gen::text AS gen FROM bumped`,
        );
        return Number(rows[0].gen);
      }),
    );
  }
}
