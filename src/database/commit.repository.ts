import { Injectable } from '@nestjs/common';
import { DataSource } from 'typeorm';
import { pg } from './postgres.js';

export interface CommitRow {
  reservationId: string;
  owner: string;
  resourceIds: string[];
  body: Record<string, unknown>;
}

@Injectable()
export class CommitRepository {
  constructor(private readonly db: DataSource) {}

  async find(reservationId: string): Promise<CommitRow | null> {
    const rows: CommitRow[] = await pg(() =>
      this.db.query(
        `SELECT reservation_id AS "reservationId", owner, resource_ids::text[] AS "resourceIds", body
           FROM t_commit WHERE reservation_id = $1`,
        [reservationId],
      ),
    );
    return rows[0] ?? null;
  }
}
