import { MigrationInterface, QueryRunner } from 'typeorm';

/**
 * The generation of the Redis state: bumped by the rebuild that follows a wipe of Redis. Every hold
 * carries the generation it was taken in, and a commit only lands in the generation it pinned in; the
 * bump waits for commits in flight (they hold a shared advisory lock, the bump an exclusive one), so a
 * commit that pinned before the wipe can never land on an item the rebuild has handed out again.
 */
export class RedisGeneration1763900000000 implements MigrationInterface {
  name = 'RedisGeneration1763900000000';

  async up(q: QueryRunner): Promise<void> {
    await q.query(`CREATE TABLE t_redis_generation (id boolean PRIMARY KEY DEFAULT true CHECK (id), gen bigint NOT NULL)`);
    await q.query(`INSERT INTO t_redis_generation (gen) VALUES (0)`);
  }

  async down(q: QueryRunner): Promise<void> {
    await q.query(`DROP TABLE t_redis_generation`);
  }
}
