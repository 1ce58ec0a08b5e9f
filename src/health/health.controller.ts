import { Controller, Get } from '@nestjs/common';
import { ApiOperation, ApiTags } from '@nestjs/swagger';
import { HealthCheck, HealthCheckService, HealthIndicatorService, TypeOrmHealthIndicator } from '@nestjs/terminus';
import { HoldStore } from '../redis/hold-store.repository.js';

@ApiTags('operations')
@Controller('health')
export class HealthController {
  constructor(
    private readonly health: HealthCheckService,
    private readonly db: TypeOrmHealthIndicator,
    private readonly indicators: HealthIndicatorService,
    private readonly holds: HoldStore,
  ) {}

  @Get('live')
  @ApiOperation({ summary: 'The process is up' })
  @HealthCheck()
  live() {
    return this.health.check([]);
  }

  @Get('ready')
  @ApiOperation({ summary: 'Postgres and Redis answer (503 otherwise)' })
  @HealthCheck()
  ready() {
    return this.health.check([
      () => this.db.pingCheck('postgres').withTimeout(1500),
      () =>
        this.indicators
          .check('redis')
          .attempt(() => this.holds.ping())
          .withTimeout(1500),
    ]);
  }
}
