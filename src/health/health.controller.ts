import { Controller, Get } from '@nestjs/common';
import { ApiExtraModels, ApiOperation, ApiResponse, ApiTags, getSchemaPath } from '@nestjs/swagger';
import { ErrorResponseDto } from '../common/api-errors.decorator.js';
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
  @ApiOperation({ summary: 'Postgres and Redis answer, and Redis may not evict keys (503 otherwise)' })
  // Over @HealthCheck's 503: the service answers it with the API's error body (src/common/http-errors.ts).
  @ApiResponse({
    status: 503,
    description:
      "DEPENDENCY_UNAVAILABLE; `details.report` is the check's report: `status`, and `info`, `error` and `details` by dependency",
    schema: { $ref: getSchemaPath(ErrorResponseDto) },
  })
  @ApiExtraModels(ErrorResponseDto)
  @HealthCheck()
  ready() {
    return this.health.check([
      () => this.db.pingCheck('postgres').withTimeout(1500),
      () =>
        this.indicators
          .check('redis')
          .attempt(() => this.holds.ready())
          .withTimeout(1500),
    ]);
  }
}
